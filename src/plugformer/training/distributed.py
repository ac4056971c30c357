"""Several processes or machines that train one model, or refuse to start.

Three ways a multi-process launch goes silently wrong, each turned into an error or a record here:

- **Independent copies.** `accelerate launch --cpu` (or no `--multi_gpu`) with `--num_processes`/`--num_machines`
  above 1 takes accelerate's simple launcher: it starts one process per machine and sets `MASTER_ADDR` and
  `MASTER_PORT` but no `WORLD_SIZE`/`RANK`, so no process group forms and each machine trains alone and exits 0. A
  launcher that does announce a world (`WORLD_SIZE`, torchrun and accelerate's `--multi_gpu`) can still leave the
  trainer alone: `use_cpu=False` without a GPU forms the gloo group but gives the Trainer world size 1.
  `check_launch` refuses both before any model is built.
- **Disagreeing resumption.** `--resume_from_checkpoint last` is resolved in each process's own `output_dir`; with
  one folder per machine (and checkpoints saved on the main machine only, the Trainer's default) one rank resumes at
  step N while another starts fresh, and the run later hangs. `agreed_checkpoint` gathers every rank's choice and
  refuses unless they match.
- **A finished run that exits -6.** Left to the interpreter's finalization, the gloo process group was destroyed
  there, and now and then a rank of a finished `accelerate launch` aborted ("terminate called without an active
  exception", SIGABRT), so the launch failed after its model was saved. `end_process_group` destroys the group while
  the interpreter is whole, at the end of every successful command (accelerate's `end_training` does the same).
- **A folder refused on one rank only.** `claim_output_dir` judges the output folder on every rank and gathers the
  verdicts (`runtime.run_folders`), so that no rank trains on while another refuses.
- **An effective batch nobody wrote down.** `effective_batch` / `log_effective_batch` give the examples (or, for
  GRPO/RLOO, completions) per optimizer step across all processes, printed once and kept in `run_info.json`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..runtime.run_folders import MANIFEST, acquire_lock, occupied_problem, release_lock, take_over


# Where a launcher announces the number of processes: torchrun / accelerate --multi_gpu / DeepSpeed set WORLD_SIZE,
# MPI launchers (accelerate's MULTI_CPU through mpirun) their own names. accelerate's `PartialState` reads the same.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
# The accelerate launch flags that describe the topology asked for (read back from the launcher's command line).
LAUNCH_FLAGS = ("num_machines", "num_processes", "machine_rank", "config_file")
LAUNCH_SWITCHES = ("cpu", "multi_gpu")
# each process saves its own random state into the checkpoint; the other files must be alike on every rank
RNG_STATE = re.compile(r"^rng_state(_\d+)?\.pth$")
USE_INSTEAD = (
    'launch with --multi_gpu and use_cpu instead: `accelerate launch --config_file "$(plugformer accelerate-config '
    'cpu_2proc.yaml)"` on one CPU machine, or `accelerate launch --multi_gpu --num_machines N --machine_rank R '
    "--main_process_ip IP --main_process_port P --num_processes TOTAL` on each machine (plugformer sets use_cpu=True "
    "without a GPU)"
)


def announced_world_size(environ: Mapping[str, str]) -> int | None:
    """The number of processes a launcher announced in `environ`, or `None` when none did.

    Example:

    >>> announced_world_size({"WORLD_SIZE": "4", "RANK": "1"})
    4
    >>> announced_world_size({"MASTER_PORT": "29500"}) is None
    True
    """
    for name in WORLD_SIZE_VARIABLES:
        if environ.get(name, "").strip().isdigit():
            return int(environ[name])
    return None


def accelerate_launch_flags(argv: list[str]) -> dict[str, str | bool]:
    """The topology flags of an `accelerate launch` command line (`--num_machines 2`, `--num-machines=2`, `--cpu`).

    The simple launcher puts none of them into the environment, so the launcher's own argv (the parent process) is
    the only place that says what was asked for.

    Example:

    >>> accelerate_launch_flags(["accelerate", "launch", "--cpu", "--num_machines", "2", "--machine-rank=1", "x.py"])
    {'cpu': True, 'num_machines': '2', 'machine_rank': '1'}
    """
    flags: dict[str, str | bool] = {}
    for index, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        name, equals, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if name in LAUNCH_SWITCHES:
            flags.setdefault(name, True)
        elif name in LAUNCH_FLAGS and name not in flags:
            if equals:
                flags[name] = value
            elif index + 1 < len(argv):
                flags[name] = argv[index + 1]
    return flags


def launch_problem(
    environ: Mapping[str, str],
    trainer_world_size: int,
    group_world_size: int | None = None,
    launcher_argv: list[str] | None = None,
) -> str | None:
    """Why this launch would train independent copies instead of one model, or `None` if it is sound.

    Args:
        environ: the process environment (`os.environ`).
        trainer_world_size: the number of processes the Trainer trains with (`TrainingArguments.world_size`).
        group_world_size: the size of the torch.distributed process group, `None` when none was formed.
        launcher_argv: the parent process's command line, to quote the flags `accelerate launch` was given.

    Example:

    >>> launch_problem({"WORLD_SIZE": "2"}, trainer_world_size=2, group_world_size=2) is None
    True
    >>> launch_problem({"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "29500"}, 1).startswith("refusing to train")
    True
    """
    announced = announced_world_size(environ)
    formed = f"torch.distributed world size {group_world_size or 1}"
    if announced is not None:
        if announced == trainer_world_size:
            return None
        # e.g. `--multi_gpu` with `use_cpu=False` on a machine without a GPU: the group forms, the Trainer stays alone
        return (
            f"refusing to train: the launcher started {announced} processes (WORLD_SIZE={announced}, "
            f"RANK={environ.get('RANK', '?')}; {formed}) but the trainer's world size is {trainer_world_size}, so "
            "each process would train an independent copy (use_cpu=False without a GPU?); pass --use_cpu true "
            "(plugformer's default without a GPU) or launch with `--config_file \"$(plugformer accelerate-config "
            'cpu_2proc.yaml)"`'
        )
    # accelerate's simple launcher always sets ACCELERATE_USE_CPU, and MASTER_ADDR/MASTER_PORT only when more than
    # one process or machine was asked for; it never sets WORLD_SIZE, so no process group can form.
    if trainer_world_size == 1 and "ACCELERATE_USE_CPU" in environ and "MASTER_PORT" in environ:
        asked = accelerate_launch_flags(launcher_argv or [])
        described = ", ".join(f"--{k}" if v is True else f"{k}={v}" for k, v in asked.items())
        return (
            f"refusing to train: `accelerate launch` was asked for several processes or machines"
            f"{f' ({described})' if described else ''} but started this process alone (it set MASTER_ADDR="
            f"{environ.get('MASTER_ADDR', '?')} MASTER_PORT={environ['MASTER_PORT']} and no WORLD_SIZE/RANK; "
            f"{formed}), so each machine would train alone, an independent copy; {USE_INSTEAD}"
        )
    return None


def group_world_size() -> int | None:
    """The size of the torch.distributed default process group, `None` when none was formed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return None


def parent_argv() -> list[str]:
    """The parent process's command line (the launcher), or `[]` where /proc cannot say (not Linux, no access)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def check_launch(training_args) -> None:
    """Raises `ValueError` if the processes of this launch would each train an independent copy.

    Reading `training_args.world_size` sets up the distributed state (the process group forms there), so call this
    before the model is built: a refused run then costs only the imports.
    """
    trainer_world_size = training_args.world_size
    problem = launch_problem(os.environ, trainer_world_size, group_world_size(), parent_argv())
    if problem is not None:
        raise ValueError(problem)


def gather_from_ranks(value) -> list:
    """`value` from every rank, in rank order (`[value]` without a process group); a collective: every rank calls."""
    world = group_world_size()
    if world is None or world == 1:
        return [value]
    values = [None] * world
    torch.distributed.all_gather_object(values, value)
    return values


def claim_output_dir(script_args, training_args, stage: str | None = None) -> None:
    """Refuses an occupied or locked `output_dir` on every rank together (`ValueError`), else locks it (main
    process) and, with `--overwrite_output_dir true`, removes the other run's checkpoints and records (`run_folders.REPLACED`).

    Call before any work: the check reads only the folder. A collective (every rank's verdict is gathered), so that
    no rank trains on while another refuses.
    """
    output_dir, resume = training_args.output_dir, training_args.resume_from_checkpoint
    overwrite = bool(getattr(script_args, "overwrite_output_dir", False))
    main = training_args.process_index == 0
    problem = occupied_problem(output_dir, resume, overwrite, stage)
    locked = False
    if problem is None and main:
        problem = acquire_lock(output_dir)
        locked = problem is None
        if locked:  # judged again under the lock: a run that finished into it since the first look is refused too
            problem = occupied_problem(output_dir, resume, overwrite, stage)
    first = next((p for p in gather_from_ranks(problem) if p), None)
    if first is not None:
        if locked:
            release_lock(output_dir)
        raise ValueError(first)
    if main:
        take_over(output_dir, overwrite, stage)


def checkpoint_files(path: str | Path) -> list[str]:
    """The files of a checkpoint that every rank needs alike: its top-level files but the per-rank
    `rng_state_<rank>.pth` and the manifest (a checkpoint copied to another machine keeps the first rank's manifest).
    Subfolders are left out: DeepSpeed (`global_stepN/`) and sharded FSDP keep per-rank shards there.

    transformers 5.24 writes model weights on global rank 0 only (`should_save_on_this_rank`), even with
    `--save_on_each_node true`: another machine's `checkpoint-N` then holds optimizer and trainer state without
    weights, and resuming from it fails on that machine alone while the others wait.
    """
    path = Path(path)
    names = (p.name for p in path.iterdir() if p.is_file())
    return sorted(name for name in names if name != MANIFEST and not RNG_STATE.match(name))


def checkpoint_disagreement(choices: list[dict], asked: str | None) -> str | None:
    """Why the ranks' resumption choices cannot be used together, or `None` when they agree.

    Args:
        choices: one dict per rank, in rank order, with `checkpoint` (a path, or `None` for a fresh start),
            `problem` (why an explicit path was refused, or `None`), optionally `files` (`checkpoint_files`) and
            `host`.
        asked: the `--resume_from_checkpoint` value, for the message.

    Ranks agree when none has a problem and all start fresh, or all resume from a checkpoint of the same name
    (`checkpoint-N`: with one output folder per machine the paths differ, the step must not) holding the same files.

    Example:

    >>> checkpoint_disagreement([{"checkpoint": "a/checkpoint-10"}, {"checkpoint": "b/checkpoint-10"}], "last") is None
    True
    >>> print(checkpoint_disagreement([{"checkpoint": "a/checkpoint-10"}, {"checkpoint": None}], "last"))
    --resume_from_checkpoint last: the ranks would not resume from the same checkpoint (rank 0: a/checkpoint-10; rank 1: none, a fresh start); give every machine the same checkpoint-N (a shared output_dir, or copy the main machine's), or resume none
    """
    if len(choices) == 1:  # a single process: only its own path can be wrong
        problem = choices[0].get("problem")
        return f"--resume_from_checkpoint {asked}: {problem}" if problem else None
    names = {Path(choice["checkpoint"]).name if choice.get("checkpoint") else None for choice in choices}
    files = [set(choice.get("files") or ()) for choice in choices]
    every = set().union(*files)
    if len(names) == 1 and all(f == every for f in files) and not any(choice.get("problem") for choice in choices):
        return None

    def described(choice: dict, files: set) -> str:
        if choice.get("problem") or not choice.get("checkpoint"):
            return choice.get("problem") or "none, a fresh start"
        # weights first: a machine whose checkpoint lacks them is the usual case (see `checkpoint_files`)
        missing = sorted(every - files, key=lambda name: (not name.endswith((".safetensors", ".bin")), name))
        return choice["checkpoint"] + (
            f" (lacks {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})" if missing else ""
        )

    ranks = "; ".join(
        f"rank {rank}{' on ' + choice['host'] if choice.get('host') else ''}: {described(choice, files[rank])}"
        for rank, choice in enumerate(choices)
    )
    return (
        f"--resume_from_checkpoint {asked}: the ranks would not resume from the same checkpoint ({ranks}); give every "
        "machine the same checkpoint-N (a shared output_dir, or copy the main machine's), or resume none"
    )


def agreed_checkpoint(checkpoint: str | None, problem: str | None, asked: str | None) -> str | None:
    """This rank's `checkpoint` once every rank has chosen the same one; raises `ValueError` listing each rank's
    choice otherwise, on every rank at once (never one rank resuming while another starts fresh, then a hang).

    A collective: every rank calls it, also when nothing is resumed, so that a machine launched with a different
    `--resume_from_checkpoint` is caught instead of leaving the others waiting.
    """
    import socket

    files = checkpoint_files(checkpoint) if checkpoint is not None else None
    mine = {"checkpoint": checkpoint, "problem": problem, "files": files, "host": socket.gethostname()}
    disagreement = checkpoint_disagreement(gather_from_ranks(mine), asked)
    if disagreement is not None:
        raise ValueError(disagreement)
    return checkpoint


def effective_batch(args, world_size: int) -> dict:
    """Examples per optimizer step across all processes: per-device batch x gradient accumulation x world size.

    TRL's GRPO/RLOO configs count completions in `per_device_train_batch_size`; each process generates its own
    `per_device_train_batch_size x steps_per_generation` completions per generation round, and a step holds
    `total / num_generations` prompts.

    Example:

    >>> from types import SimpleNamespace
    >>> effective_batch(SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2), 2)["total"]
    16
    """
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    record = {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "world_size": world_size,
        "total": per_device * accumulation * world_size,
        "unit": "examples",
    }
    generations = getattr(args, "num_generations", None)
    if generations:
        steps_per_generation = getattr(args, "steps_per_generation", None) or accumulation
        record.update(
            unit="completions",
            num_generations=generations,
            prompts=record["total"] // generations,
            completions_generated_per_process=per_device * steps_per_generation,
        )
    return record


def describe_effective_batch(record: dict) -> str:
    """One line for the log, e.g. `effective batch 16 examples per optimizer step = 4 per device x 2 accumulation
    x 2 processes`."""
    text = (
        f"effective batch {record['total']} {record['unit']} per optimizer step = {record['per_device_train_batch_size']}"
        f" per device x {record['gradient_accumulation_steps']} accumulation x {record['world_size']} processes"
    )
    if "prompts" in record:
        text += (
            f" ({record['prompts']} prompts x {record['num_generations']} generations; each process generates "
            f"{record['completions_generated_per_process']} completions per round)"
        )
    return text


def log_effective_batch(trainer, stage: str) -> dict:
    """`effective_batch` of `trainer`, printed once (world process zero), for `run_info.json`."""
    record = effective_batch(trainer.args, trainer.accelerator.num_processes)
    if trainer.is_world_process_zero():
        print(f"[{stage}] {describe_effective_batch(record)}", flush=True)
    return record


def end_process_group() -> None:
    """Destroys this process's default process group, if one is up: called by the command line after a command
    succeeded, so the group is released before the interpreter's finalization (nothing else holds it by then: the
    trainers and wrappers went with the command). No barrier first: a rank whose peer still works alone (the main
    process scoring the saved model) would wait on it and could time out."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
