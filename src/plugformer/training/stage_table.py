"""The stage table: one registered `Stage` record per training stage, read by the pipeline, the CLI, compare, the data
loader and the model cards, none of which tests a stage's name (torchtitan's `TrainSpec` is the model).

Each stage's own module (`training/stages/sft.py`, ...) holds its script arguments and builds its record, which it
registers with `register_stage`; a duplicate name raises. Importing this module imports no stage, and a stage module
imports TRL only inside its `train` function, so `plugformer train --help` lists the stages without loading TRL.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from .cards import StageCard


@dataclass(frozen=True, kw_only=True)
class StageInput:
    """A finished stage, besides its parent, whose output directory a stage reads through a command-line flag; the
    pipeline says which of `sources` through its option `option` (absent from the pipeline's arguments: `default`).

    Args:
        flag (`str`): The stage's flag taking the directory, e.g. `"--reward_model_path"`.
        option (`str`): The `plugformer pipeline` option naming the source stage, e.g. `"rlhf_reward"`.
        sources (`tuple[str, ...]`): The stages whose output the flag accepts.
        default (`str`): The source when the pipeline's arguments do not choose one (and in `plugformer compare`).
    """

    flag: str
    option: str
    sources: tuple[str, ...]
    default: str


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One training stage.

    Args:
        name (`str`): The stage's name: `plugformer train <name>`, `configs/<name>/*.yaml`, the pipeline's folder.
        parent (`str`, *optional*): The stage whose output it starts from (`--model_name_or_path`); `None` builds a
            new model (which is also where `plugformer compare` sends `PlugformerConfig` fields).
        script_arguments (`type`): Its dataclass of script arguments (in its module; the shared bases are
            `training/arguments.py`'s).
        config_class (`str`): Its trainer config class: `"TrainingArguments"`, `"Seq2SeqTrainingArguments"` or the
            name of a TRL config class.
        description (`str`): One line for `plugformer train --help`.
        data_format (`str`): The TRL dataset format it reads, a key of `plugformer.data.formats.FORMAT_COLUMNS`.
        data_parallel (`bool`): Whether `plugformer pipeline --jobs N` may split its per-device batch over idle
            cores: true where that batch is a set of examples, false for online RL (a batch of sampled groups).
        card (`StageCard`): Its model card's summary, trainer and pipeline tag.
        language_model_loss (`bool`, *optional*, defaults to `False`): Whether its `eval_loss` is a language-model
            loss, so that `run_info.json` records the dev perplexity (DPO's loss is not one).
        inputs (`tuple[StageInput, ...]`, *optional*): Further stages it reads (rlhf: the model that rewards it).
        baseline (`bool`, *optional*, defaults to `False`): A comparison point (rft, sft_matched): the pipeline's
            table reports the other stages' gains against it, and never hands it on as the final model.
        pipeline_default (`bool`, *optional*, defaults to `True`): Whether `plugformer pipeline` runs it when its
            `stages` are not given (classify, which no policy stage builds on, runs only when listed).
        adapters (`bool`, *optional*, defaults to `True`): Whether `--use_peft true` trains LoRA adapters on its
            model (`--lora_*`); `False` for a stage that trains every weight whatever is asked, where the flag is
            refused (`refuse_unhonoured_options`) rather than ignored.
        train (`Callable`): `train(script_args, model_args, training_args) -> dict`, what `run_info.json` holds.
    """

    name: str
    parent: str | None
    script_arguments: type
    config_class: str
    description: str
    data_format: str
    data_parallel: bool
    card: StageCard
    language_model_loss: bool = False
    inputs: tuple[StageInput, ...] = ()
    baseline: bool = False
    pipeline_default: bool = True
    adapters: bool = True
    train: Callable[..., dict]

    def config_type(self) -> type:
        """The trainer config class (imports transformers or TRL)."""
        if self.config_class in ("TrainingArguments", "Seq2SeqTrainingArguments"):
            import transformers

            return getattr(transformers, self.config_class)
        return getattr(importlib.import_module("trl"), self.config_class)


class StageTable(Mapping[str, Stage]):
    """The registered stages by name, in registration order (the pipeline's default order)."""

    def __init__(self):
        self._table: dict[str, Stage] = {}

    def register(self, stage: Stage) -> Stage:
        """Adds `stage`; a name already registered raises instead of silently replacing it."""
        if not isinstance(stage, Stage):
            raise ValueError(f"register_stage: expected a Stage record, got {type(stage).__name__}")
        if not stage.name or not isinstance(stage.name, str):
            raise ValueError(f"stage name={stage.name!r}: expected a non-empty string")
        if stage.name in self._table:
            raise ValueError(f"stage {stage.name!r} is already registered ({self._table[stage.name].description})")
        self._table[stage.name] = stage
        return stage

    def get_stage(self, name: str) -> Stage:
        """The record of `name`; an unknown name raises a `ValueError` listing the stages."""
        if name not in self._table:
            raise ValueError(f"unknown stage {name!r}; stages: {list(self._table)}")
        return self._table[name]

    def __getitem__(self, name: str) -> Stage:
        return self._table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


STAGES = StageTable()


def register_stage(stage: Stage) -> Stage:
    """Registers `stage` in `STAGES` (see `StageTable.register`) and returns it."""
    return STAGES.register(stage)


# TRL's `ModelConfig` options that shape LoRA adapters: without `--use_peft true` nothing reads them
LORA_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
                "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora")  # fmt: skip


def refuse_unhonoured_options(stage: Stage, model_args) -> None:
    """Raises `ValueError` before any work for a `ModelConfig` option that `stage` would accept and ignore, one rule
    for every stage (read from its record, never its name): `--use_peft true` where the stage trains every weight
    (`Stage.adapters` false: pretrain trained a full model, no word), or with no `--model_name_or_path` (LoRA on a
    random initialisation adapts nothing: seq2seq trained it), and a `--lora_*` option without `--use_peft true`."""
    if model_args.use_peft and not stage.adapters:
        honouring = [name for name, entry in STAGES.items() if entry.adapters]
        raise ValueError(
            f"--use_peft true: the {stage.name} stage trains every weight of its model, no LoRA adapters "
            f"(the stages that train adapters: {', '.join(honouring)}); drop --use_peft"
        )
    if model_args.use_peft and model_args.model_name_or_path is None:
        trained = f"a finished {stage.parent} run" if stage.parent else f"a trained model, e.g. a {stage.name} run"
        raise ValueError(
            f"--use_peft true without --model_name_or_path: LoRA adapts a trained model, and the "
            f"{stage.name} stage would start from a random initialisation; give --model_name_or_path "
            f"({trained}) or drop --use_peft"
        )
    if not model_args.use_peft:
        defaults = {field.name: field.default for field in dataclasses.fields(model_args)}
        for name in LORA_OPTIONS:
            value = getattr(model_args, name, defaults.get(name))
            if name in defaults and value != defaults[name]:
                raise ValueError(
                    f"--{name} {value!r} shapes LoRA adapters, which the {stage.name} stage trains only "
                    "with --use_peft true; add --use_peft true or drop it"
                )
