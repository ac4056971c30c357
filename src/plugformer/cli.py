"""The `plugformer` command: one table of subcommands."""

from __future__ import annotations

import sys
from collections.abc import Callable

from .runtime.files import DiskFullError


def _demo(argv: list[str]) -> None:
    from .experiments.demo import main

    main(argv)


def _convert(argv: list[str]) -> None:
    """plugformer convert SOURCE_DIR OUTPUT_DIR [--set field=value ...] [--overwrite_output_dir true]"""
    import argparse

    from transformers.hf_argparser import string_to_bool as str_to_bool

    from .integrations.convert import convert
    from .runtime.arguments import REPEATED_FLAGS_RULE, merge_repeated_flags
    from .runtime.yaml_text import load_yaml_text

    parser = argparse.ArgumentParser(
        prog="plugformer convert",
        allow_abbrev=False,
        epilog=REPEATED_FLAGS_RULE,
        description="Import a Llama, Qwen3, Qwen3-Next, GPT-2 or DeepSeek-V3 checkpoint.",
    )
    parser.add_argument(
        "source",
        help="transformers checkpoint directory (model_type llama, qwen3, qwen3_next, gpt2 or deepseek_v3)",
    )
    parser.add_argument("output_dir", help="where the plugformer model is saved")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="config override (repeat it: the overrides accumulate)",
    )
    parser.add_argument(
        "--overwrite_output_dir",
        nargs="?",
        const="true",
        default="false",
        type=str_to_bool,
        metavar="BOOL",
        help="replace the run or model already in OUTPUT_DIR (its checkpoints and "
        "records removed), as for `plugformer train`",
    )
    parser.add_argument("--overwrite", action="store_true", help="the same as --overwrite_output_dir true")
    args = parser.parse_args(merge_repeated_flags(parser, list(argv), parser.prog, extra=()))
    overrides = {}
    for item in args.set:
        field, separator, value = item.partition("=")
        if not separator:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
        overrides[field] = load_yaml_text(value, f"--set {field}")
    model = convert(args.source, args.output_dir, overwrite=args.overwrite_output_dir or args.overwrite, **overrides)
    print(
        f"saved {type(model).__name__} ({model.config.attention_score}, {model.config.position_scheme}) to {args.output_dir}"
    )


def _train(argv: list[str]) -> None:
    """plugformer train STAGE [--config FILE.yaml] [--key value ...]"""
    from .training import STAGES, run_stage

    if not argv or argv[0] not in STAGES:
        width = max(map(len, STAGES)) + 2  # a name never runs into its description
        stages = "\n".join(f"  {name:{width}s}{stage.description}" for name, stage in STAGES.items())
        _usage(f"usage: plugformer train <stage> [--config FILE.yaml] [--key value ...]\n\nstages:\n{stages}", argv)
    run_stage(argv[0], argv[1:])


def _pipeline(argv: list[str]) -> None:
    from .experiments.pipeline import main

    main(argv)


def _eval(argv: list[str]) -> None:
    from .evaluation.scoring import main

    main(argv)


def _seeds(argv: list[str]) -> None:
    from .experiments.seeds import main

    main(argv)


def _compare(argv: list[str]) -> None:
    from .experiments.compare import main

    main(argv)


def _extrapolate(argv: list[str]) -> None:
    from .experiments.extrapolation import main

    main(argv)


def _attention_map(argv: list[str]) -> None:
    from .evaluation.attention_maps import main

    main(argv)


def _plot(argv: list[str]) -> None:
    from .evaluation.plots import main

    main(argv)


def _bench(argv: list[str]) -> None:
    from .bench import main

    main(argv)


def _accelerate_config(argv: list[str]) -> None:
    """plugformer accelerate-config [NAME]"""
    from .runtime.launch import main

    main(argv)


def _info(argv: list[str]) -> None:
    """plugformer info [--markdown | --readme README.md]"""
    from .runtime.readme_tables import main

    main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "demo": (_demo, "train a tokenizer and a small model offline, then generate through pipeline()"),
    "convert": (_convert, "import a Llama, Qwen3, Qwen3-Next, GPT-2 or dense DeepSeek-V3 checkpoint (same logits)"),
    "train": (_train, "train one stage (the stages listed below), also under accelerate launch"),
    "pipeline": (_pipeline, "run pretrain -> sft -> reward -> rlhf / dpo / grpo and compare held-out accuracy"),
    "seeds": (_seeds, "one table over several pipeline runs: test exact match and gains, 95% CI over seeds"),
    "eval": (_eval, "score a trained stage on a split: exact match (95% CI), perplexity, pairwise accuracy"),
    "compare": (_compare, "train a grid of variants x seeds; mean ± 95% CI, paired significance tests, plot"),
    "extrapolate": (_extrapolate, "perplexity vs evaluation length (0.5x-8x training length) per position scheme"),
    "attention-map": (_attention_map, "heatmaps of attention weights (self and cross) for a text, as PNG"),
    "plot": (_plot, "plots of position schemes (sinusoidal PE, learned bias vs distance, ALiBi) and training curves"),
    "bench": (_bench, "plugformer vs transformers Llama/GPT-2 (A/B: train, decode, memory, MFU) and every variant"),
    "info": (_info, "list which kernels run each attention_score x position_scheme; --readme: regenerate its tables"),
    "accelerate-config": (_accelerate_config, "path of a shipped accelerate YAML, for --config_file (no NAME: list)"),
}


def _usage(text: str, argv: list[str]) -> None:
    """Prints `text` and exits: asked for (`-h`/`--help`) on stdout with status 0, as argparse does; else (no or
    an unknown command) on stderr with status 2."""
    asked = bool(argv) and argv[0] in ("-h", "--help")
    print(text, file=sys.stdout if asked else sys.stderr)
    raise SystemExit(0 if asked else 2)


def _version() -> str:
    """The installed distribution's version (the package's own `__version__` when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plugformer")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def top_level_usage() -> str:
    """`plugformer --help`: every command of `COMMANDS` and every stage of the stage table (`training.STAGES`), read
    from them, so that a new command or stage is listed without an edit here."""
    import textwrap

    from .training import STAGES

    width = max(map(len, COMMANDS)) + 2  # a name as long as "accelerate-config" must not run into its text
    commands = "\n".join(f"  {name:{width}s}{description}" for name, (_, description) in COMMANDS.items())
    # unindented: an indented line is a command's (tests/test_project.py reads them so)
    stages = textwrap.fill(" | ".join(STAGES), width=100, break_on_hyphens=False)
    return (
        f"usage: plugformer [--debug | --version] <command> [options]\n\ncommands:\n{commands}\n\n"
        f"stages of `plugformer train <stage>` (described by `plugformer train --help`):\n{stages}"
    )


# raised for what the user gave (flags, files, folders); anything else is a bug and keeps its traceback
# and a full disk (`files.DiskFullError`: an ENOSPC/EDQUOT write, named with the space free and what is intact)
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, DiskFullError)
DEBUG_VARIABLE = "PLUGFORMER_DEBUG"


def main(argv: list[str] | None = None) -> None:
    """`plugformer [--debug] <command> [options]`. A user error prints as one line, `ValueError: ...`, and exits with
    status 2, Ctrl-C as one line with status 130; `--debug` (before the command) or `PLUGFORMER_DEBUG=1` shows the
    traceback instead."""

    from .runtime.flags import environment_flag
    from .runtime.offline import apply_offline_defaults

    apply_offline_defaults()  # nothing leaves the machine unless the user set HF_HUB_OFFLINE / ..._TELEMETRY itself
    argv = sys.argv[1:] if argv is None else argv
    debug = environment_flag(DEBUG_VARIABLE)
    if argv and argv[0] == "--debug":  # before the command: `train` and `pipeline` have a --debug option of their own
        debug, argv = True, argv[1:]
    if argv and argv[0] in ("-V", "--version"):
        print(f"plugformer {_version()}")
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        _usage(top_level_usage(), argv)
    from .runtime.denormals import flushing_denormals
    from .runtime.interrupts import end_quiet_start

    end_quiet_start()  # Ctrl-C while starting was answered by `runtime.interrupts`; from here, by the handler below
    try:
        with flushing_denormals():  # before any work, so that torch's thread pool starts in this mode
            COMMANDS[argv[0]][0](argv[1:])
    except USER_ERRORS as error:
        if debug:
            raise
        message = " ".join(str(error).split())  # one line, whatever the message's own line breaks
        print(
            f"{type(error).__name__}: {message} [plugformer {argv[0]}; traceback: plugformer --debug ... or "
            f"{DEBUG_VARIABLE}=1]",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    except KeyboardInterrupt as interrupt:  # Ctrl-C: what it left behind, in one line (a stage says; see outputs)
        if debug:
            raise
        message = " ".join(str(interrupt).split()) or "interrupted"
        print(f"KeyboardInterrupt: {message} [plugformer {argv[0]}]", file=sys.stderr)
        raise SystemExit(130) from None  # 128 + SIGINT, as a shell reports a Ctrl-C
    from .training.distributed import end_process_group

    end_process_group()  # under `accelerate launch`: the group goes before the interpreter's finalization
