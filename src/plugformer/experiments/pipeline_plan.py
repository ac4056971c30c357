"""Which stages `plugformer pipeline` runs, in what order and with which command line: each stage's parent and
inputs (its record's `parent` and `inputs`) must come before it, and its folder is `<output_dir>/<stage>`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..runtime.arguments import config_path, stage_config
from ..training import STAGES


if TYPE_CHECKING:
    from ..training.stage_table import StageInput
    from .pipeline import PipelineArguments


def input_source(args: PipelineArguments, needed: StageInput) -> str:
    """The stage whose output goes to `needed.flag`: the pipeline option that chooses it, else the input's default."""
    return getattr(args, needed.option, needed.default)


def needed_stages(args: PipelineArguments, stage: str) -> list[str]:
    """The stages `stage` reads: its parent, then the sources of its inputs (rlhf: the stage that rewards it)."""
    record = STAGES[stage]
    return [s for s in (record.parent, *(input_source(args, i) for i in record.inputs)) if s is not None]


def requirements(args: PipelineArguments) -> dict[str, set[str]]:
    """The stages of `args.stages` each stage needs finished first (`needed_stages`, within the run)."""
    return {stage: set(needed_stages(args, stage)) & set(args.stages) for stage in args.stages}


def stage_argv(args: PipelineArguments, stage: str) -> list[str]:
    """The command line of one stage: its YAML, its directory, its parent's directory, the shared seeds."""
    if stage not in STAGES:
        raise ValueError(f"stages={args.stages}: {stage!r} is not one of {list(STAGES)}")
    parent = STAGES[stage].parent
    if parent is not None and parent not in args.stages:
        raise ValueError(f"stage {stage!r} starts from {parent!r}, which is not in stages={args.stages}")
    if parent is not None and args.stages.index(parent) > args.stages.index(stage):
        raise ValueError(f"stages={args.stages}: {parent!r} must come before {stage!r}")
    config = config_path(stage_config(args.stage_configs, stage), flag=f"--stage_configs {args.stage_configs}")
    argv = ["--config", config, "--output_dir", stage_dir(args, stage)]
    argv += ["--seed", str(args.seed), "--dataset_seed", str(args.dataset_seed)]
    if parent is not None:
        argv += ["--model_name_or_path", stage_dir(args, parent)]
    for needed in STAGES[stage].inputs:  # rlhf: the stage that rewards it
        source = input_source(args, needed)
        if source not in args.stages:
            raise ValueError(
                f"stage {stage!r} reads the {source!r} stage through {needed.flag} ({needed.option}="
                f"{source!r}), which is not in stages={args.stages}"
            )
        if args.stages.index(source) > args.stages.index(stage):
            raise ValueError(f"stages={args.stages}: {source!r} ({needed.option}) must come before {stage!r}")
        argv += [needed.flag, stage_dir(args, source)]
    return argv


def stage_dir(args: PipelineArguments, stage: str) -> str:
    return str(Path(args.output_dir) / stage)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def validate_stages(args: PipelineArguments) -> None:
    """Parses every stage's YAML and command line before the first stage trains: a typo in the last stage's YAML
    fails now, not after the others have trained."""
    from ..training import parse_stage_arguments

    for stage in args.stages:
        try:
            parse_stage_arguments(stage, stage_argv(args, stage))
        except ValueError as error:
            raise ValueError(
                f"--stage_configs {args.stage_configs}: stage {stage!r} "
                f"({stage_config(args.stage_configs, stage)}): {error}"
            ) from error
        except SystemExit as error:  # argparse has printed what it refused; name the stage and its YAML
            raise ValueError(
                f"--stage_configs {args.stage_configs}: stage {stage!r} "
                f"({stage_config(args.stage_configs, stage)}): its arguments do not "
                "parse (argparse's message above says which)"
            ) from error
