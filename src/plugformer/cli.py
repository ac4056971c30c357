"""The `plugformer` command: one table of subcommands."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from .runtime.files import DiskFullError


def train(argv: list[str]) -> None:
    """`plugformer train STAGE [--config FILE.yaml] [--key value ...]`; without a known stage, the stages listed."""
    from .training import STAGES, run_stage

    if not argv or argv[0] not in STAGES:
        width = max(map(len, STAGES)) + 2  # a name never runs into its description
        stages = "\n".join(f"  {name:{width}s}{stage.description}" for name, stage in STAGES.items())
        _usage(f"usage: plugformer train <stage> [--config FILE.yaml] [--key value ...]\n\nstages:\n{stages}", argv)
    run_stage(argv[0], argv[1:])


# {command: (what runs it, description)}: "module:function" relative to this package, imported only when that command
# runs (`plugformer --help` loads no trainer), or the function itself; it takes the command's arguments.
COMMANDS: dict[str, tuple[str | Callable[[list[str]], object], str]] = {
    "demo": ("experiments.demo:main", "train a tokenizer and a small model offline, then generate through pipeline()"),
    "convert": (
        "integrations.convert:main",
        "import a Llama, Qwen3, Qwen3-Next, GPT-2 or dense DeepSeek-V3 checkpoint (same logits)",
    ),
    "train": (train, "train one stage (the stages listed below), also under accelerate launch"),
    "pipeline": (
        "experiments.pipeline:main",
        "run pretrain -> sft -> reward -> rlhf / dpo / grpo and compare held-out accuracy",
    ),
    "seeds": (
        "experiments.seeds:main",
        "one table over several pipeline runs: test exact match and gains, 95% CI over seeds",
    ),
    "eval": (
        "evaluation.scoring:main",
        "score a trained stage on a split: exact match (95% CI), perplexity, pairwise accuracy",
    ),
    "compare": (
        "experiments.compare:main",
        "train a grid of variants x seeds; mean ± 95% CI, paired significance tests, plot",
    ),
    "extrapolate": (
        "experiments.extrapolation:main",
        "perplexity vs evaluation length (0.5x-8x training length) per position scheme",
    ),
    "attention-map": (
        "evaluation.attention_maps:main",
        "heatmaps of attention weights (self and cross) for a text, as PNG",
    ),
    "plot": (
        "evaluation.plots:main",
        "plots of position schemes (sinusoidal PE, learned bias vs distance, ALiBi) and training curves",
    ),
    "bench": (
        "bench:main",
        "plugformer vs transformers Llama/GPT-2 (A/B: train, decode, memory, MFU) and every variant",
    ),
    "info": (
        "runtime.readme_tables:main",
        "list which kernels run each attention_score x position_scheme; --readme: regenerate its tables",
    ),
    "accelerate-config": (
        "runtime.launch:main",
        "path of a shipped accelerate YAML, for --config_file (no NAME: list)",
    ),
}


def run_command(name: str, argv: list[str]) -> None:
    """Runs command `name` of `COMMANDS` with its arguments `argv`."""
    target = COMMANDS[name][0]
    if isinstance(target, str):
        module, _, function = target.partition(":")
        target = getattr(importlib.import_module(f".{module}", __package__), function)
    target(argv)


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
            run_command(argv[0], argv[1:])
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
