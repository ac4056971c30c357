"""The training pipeline: one stage per module, each wrapping transformers' `Trainer` or a TRL trainer.

`plugformer train <stage> --config configs/<stage>/<name>.yaml [--key value ...]`, also under
`accelerate launch -m plugformer train <stage> ...`. Each stage's `--model_name_or_path` is the previous stage's
output directory: pretrain -> sft -> reward -> rlhf, sft -> dpo, sft -> grpo; the baselines sft -> rft and
pretrain -> sft_matched (compute-matched to an RL stage); pretrain -> classify (labelled text); seq2seq (an
encoder-decoder on source -> target pairs) from a preset, as pretrain; nli (the decomposable attention model on
sentence pairs) from scratch. A stage is one `Stage` record (`training/stage_table.py`) that its module in
`training/stages/` registers.
"""

from __future__ import annotations

from ..runtime.arguments import (
    STAGE_FLAGS_RULE,
    check_numbers,
    check_yaml_types,
    config_path,
    merge_repeated_flags,
    naming_the_option,
    option_values,
    read_yaml,
)
from . import stages  # noqa: F401 (registers the shipped stages)
from .stage_table import STAGES, Stage, StageInput, refuse_unhonoured_options, register_stage
from .trainer_options import (
    RENAMED_TRAINER_OPTIONS,
    accept_renamed_trainer_options,
    renamed_trainer_flags,
    renamed_trainer_options,
    trainer_option_aliases,
)


__all__ = ["STAGES", "Stage", "StageInput", "check_stage_yaml", "parse_stage_arguments", "register_stage", "run_stage"]


def parse_stage_arguments(stage: str, argv: list[str]) -> tuple:
    """(script arguments, TRL `ModelConfig`, trainer config) from defaults < `--config` YAML < `argv`."""
    from trl import ModelConfig, TrlParser

    from .sharding import DEEPSPEED_ON_CPU_DEFAULTS, deepspeed_on_cpu

    entry = STAGES.get_stage(stage)

    class StageParser(TrlParser):
        """TRL's parser; a YAML's renamed trainer options go to the fields the installed trainer reads (`trainer_options`)."""

        def set_defaults_with_config(self, **values) -> list[str]:  # a YAML's keys, matched to options by dest
            return super().set_defaults_with_config(**renamed_trainer_options(values))

    prog = f"plugformer train {stage}"
    # never abbreviated (`--max_step 1` is not `--max_steps 1`); a repeated list option accumulates, any other
    # repeated option is refused (a key of the --config YAML given on the command line is no repeat: it wins)
    parser = StageParser(
        (entry.script_arguments, ModelConfig, entry.config_type()),
        prog=prog,
        allow_abbrev=False,
        description=entry.description,
        epilog=STAGE_FLAGS_RULE,
    )
    accept_renamed_trainer_options(parser)
    if deepspeed_on_cpu():
        # DeepSpeed's CPU accelerator (configs/accelerate/cpu_zero2.yaml, cpu_zero3.yaml): use_cpu would make accelerate
        # skip DeepSpeed, no backend would leave each process a world of its own, bf16 is refused without a GPU.
        parser.set_defaults(**DEEPSPEED_ON_CPU_DEFAULTS)
    elif not _accelerator_available():
        # Without use_cpu, TRL's bf16 default is refused on a CPU, and `accelerate launch` on CPU starts independent
        # copies instead of gloo data parallelism (see configs/accelerate/cpu_2proc.yaml). YAML/CLI still override.
        parser.set_defaults(use_cpu=True)
    argv = merge_repeated_flags(parser, list(argv), prog)  # as written: its message quotes the flags given
    try:  # a renamed trainer option's two names are one option (`--gradient_checkpointing`, `--activation_...`)
        argv = merge_repeated_flags(parser, renamed_trainer_flags(argv), prog)
    except ValueError as error:
        names = ", ".join(f"--{old} is --{new}" for new, old in RENAMED_TRAINER_OPTIONS.items())
        raise ValueError(f"{error} (renamed trainer options: {names})") from None
    for index, value in enumerate(argv[:-1]):
        if value == "--config":  # a shipped YAML also from outside the checkout
            argv[index + 1] = config_path(argv[index + 1])
            check_stage_yaml(argv[index + 1], parser.dataclass_types)
    check_config_files(argv)
    check_mapping_options(argv, parser.dataclass_types)
    try:
        parsed = parser.parse_args_and_config(argv)
    except ZeroDivisionError as error:  # TRL's GRPO/RLOO configs divide batch sizes by num_generations unchecked
        raise ValueError(
            f"stage {stage!r}: --num_generations must be at least 2 (answers compared per prompt), and the batch "
            f"sizes multiples of it ({error})"
        ) from error
    except (ValueError, OverflowError) as error:  # raised by transformers' or TRL's config for a value given
        named = naming_the_option(error, argv)
        if named is None:
            raise
        raise named from error
    check_numbers(*parsed)  # --learning_rate inf, --max_grad_norm nan: refused before any work
    refuse_unhonoured_options(entry, parsed[1])  # --use_peft where the stage trains every weight, ...
    return parsed


# trainer options that take a JSON file (or a JSON object): transformers reads a missing one with a bare
# FileNotFoundError (accelerator_config) or an AttributeError (fsdp_config); deepspeed needs its package first
CONFIG_FILE_OPTIONS = ("--accelerator_config", "--fsdp_config", "--deepspeed")


def check_mapping_options(argv: list[str], classes) -> None:
    """Raises `ValueError` naming an option whose field takes a mapping (`--lr_scheduler_kwargs`, TRL's
    `--model_init_kwargs`, ...) given text that starts like a JSON object but is none: the libraries parse it in their
    `__post_init__` with a bare `JSONDecodeError` that names no option."""
    import json
    import typing

    # the annotations, not `dataclasses.fields(cls)[...].type`: building the parser rewrote those unions to `str`
    mappings = {
        f"--{name}" for cls in classes for name, kind in typing.get_type_hints(cls).items() if "dict" in str(kind)
    }
    for name, value in option_values(argv):
        if name not in mappings or not value.lstrip().startswith("{"):
            continue
        try:
            json.loads(value)
        except ValueError as error:
            raise ValueError(f"{name} {value!r}: not a JSON object ({error}); e.g. {name} '{{\"key\": 1}}'") from None


def check_config_files(argv: list[str]) -> None:
    """Raises `ValueError` naming a `CONFIG_FILE_OPTIONS` option whose value is neither a JSON object nor a readable
    file holding one, or `--deepspeed` without the deepspeed package."""
    import importlib.util
    import json
    from pathlib import Path

    for name, value in option_values(argv):
        if name not in CONFIG_FILE_OPTIONS or value.lstrip().startswith("{"):
            continue
        if not Path(value).is_file():
            raise ValueError(f"{name} {value!r}: no such file; give a JSON file or a JSON object")
        try:
            with open(value, encoding="utf-8") as handle:
                loaded = json.load(handle)
        except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON
            raise ValueError(f"{name} {value!r}: not a readable JSON file ({error}); give a JSON object") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{name} {value!r}: holds a JSON {type(loaded).__name__}; give a JSON object")
        if name == "--deepspeed" and importlib.util.find_spec("deepspeed") is None:
            raise ValueError(f"--deepspeed {value}: the deepspeed package is not installed (pip install deepspeed)")


def check_stage_yaml(path: str, classes) -> None:
    """A stage's YAML, checked before TRL's parser reads it: each value of the type its field takes (`env`, TRL's
    mapping of environment variables, a mapping); unknown keys are left to TRL's parser, which refuses them."""
    values = read_yaml(path)
    if isinstance(values, dict):
        if not isinstance(values.get("env", {}), dict):
            raise ValueError(f"--config {path}: env: {values['env']!r}: expected a mapping of variable: value")
        check_yaml_types(
            path, {k: v for k, v in values.items() if k != "env"}, tuple(classes), aliases=trainer_option_aliases()
        )


def run_stage(stage: str, argv: list[str]) -> dict:
    """Parses `argv` and trains `stage`; returns what it wrote to `run_info.json`."""
    from transformers import set_seed

    from .sharding import enable_fsdp2_on_cpu, prepare_deepspeed_on_cpu, refuse_unshardable_request

    prepare_deepspeed_on_cpu()  # before deepspeed is imported: a DeepSpeed launch without CUDA gets its CPU accelerator
    enable_fsdp2_on_cpu()  # before any AcceleratorState exists: an FSDP2 launch on CPU shards instead of becoming DDP
    script_args, model_args, training_args = parse_stage_arguments(stage, argv)
    refuse_unshardable_request(training_args)
    # before any model is built: new weights (a fresh model, a reward head) are part of the seeded run
    set_seed(training_args.seed)
    return STAGES[stage].train(script_args, model_args, training_args)


def _accelerator_available() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
