"""An output folder belongs to one run, and a run into it is a transaction: its records describe the weights beside
them, or say that a run is in progress.

transformers 5.24's `TrainingArguments` no longer has `overwrite_output_dir`: a run into a folder that holds another
run's model and checkpoints overwrites the model, and the checkpoint rotation then keeps whichever `checkpoint-N` has
the highest step — possibly the other run's, which `--resume_from_checkpoint last` would later resume inside this
one. A claim (`claim_folder`; a training run's, on every rank together, is `training.distributed.claim_output_dir`)
refuses such a folder unless the run resumes its own checkpoint (`--resume_from_checkpoint`) or says
`--overwrite_output_dir true`, and takes a lock file against a second live run in the same folder. A lock whose
process is dead (a killed run) is taken over with a warning; takers go one at a time (an `flock` on a guard file
beside the lock, released by the kernel when its holder dies), so two processes can never both take over the same
stale lock.

A checkpoint of another folder resumes only into a folder that holds no run (or with `--overwrite_output_dir true`).
The overwrite removes only what plugformer wrote (`overwritten`): the records of a plugformer run, the checkpoints
its manifest vouches for, the LoRA `adapter/` and last-step model that went with its model, and `plugformer eval`'s
results; a folder holding `checkpoint-*` that plugformer did not publish is refused, naming them.

Before training writes anything, `begin_run` marks the folder's run in progress (`RUN_RECORD`'s `status`) and
removes a finished run's records, `run_info.json` first; `run_info.json` is written last, when the new model, its
trainer state and card are in place (`finish_run`). A run interrupted in between (a kill, Ctrl-C: `interrupted_run`
says so in one line) leaves no record of another model beside its weights.

The folder records which stage claimed it (`RUN_RECORD`, beside `run_info.json` once the run finishes): resuming in
a folder of another stage (`train sft --output_dir <a pretrain run> --resume_from_checkpoint last` continued the
pretrain trainer's state at learning rate 0 and rewrote its record) is refused, and so is resuming a finished run
that saved no checkpoint (it would train again from scratch over the finished model). `demo` and `convert` follow
the same rule (`claim_folder`); a `convert` that fails hands the folder back (`claimed_folder`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

from .files import write_json_atomic


logger = logging.getLogger(__name__)

# what plugformer's checkpoints leave in a run folder (`training.checkpoints` writes them): each `checkpoint-N`
# published whole with its manifest, the step of the newest one, the staging area a checkpoint is written in
MANIFEST = "checkpoint_manifest.json"
PROGRESS = "last_checkpoint.json"  # in the output folder: the step of the newest checkpoint published
STAGING = ".staging"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
# the subfolder that holds the last step's model when dev selection handed on an earlier one (`save_last_step`)
LAST_STEP_DIR = "last_step"

LOCK = ".plugformer.lock"
TAKEOVER = ".plugformer.lock.takeover"  # flock'ed while a process judges and takes the lock: takers go one at a time
# {"stage": ..., "status": "in_progress" | "finished"}: the stage that claimed the folder (read by a resume) and
# whether its run_info.json describes the model beside it
RUN_RECORD = ".plugformer_run.json"
IN_PROGRESS, FINISHED = "in_progress", "finished"
# a finished run's records of its model: removed before another run replaces it, run_info.json first
RECORDS = ("run_info.json", "trainer_state.json")
# removed by --overwrite_output_dir in a folder of a plugformer run, beside its checkpoints, eval results and claim:
# the step it reached, and the LoRA adapters and last-step model that belong to its model
REPLACED = (*RECORDS, PROGRESS, "adapter", LAST_STEP_DIR)
# what a finished or interrupted run leaves in its folder (TensorBoard's runs/ and a README alone are no model)
RUN_FILES = ("run_info.json", "trainer_state.json", "config.json", "*.safetensors", "checkpoint-*", "adapter")


def run_files(output_dir: str | Path) -> list[str]:
    """The names in `output_dir` that belong to a run (`RUN_FILES`), sorted."""
    output = Path(output_dir)
    if not output.is_dir():
        return []
    return sorted({path.name for pattern in RUN_FILES for path in output.glob(pattern)})


def recorded_stage(folder: str | Path) -> tuple[str | None, str | None]:
    """(the stage of the run in `folder`, the file that says so): `run_info.json` of a finished run, else the
    `RUN_RECORD` its claim wrote; `(None, None)` when neither reads."""
    for name in ("run_info.json", RUN_RECORD):
        try:
            stage = json.loads(Path(folder, name).read_text()).get("stage")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(stage, str):
            return stage, name
    return None, None


def eval_results(folder: str | Path) -> list[Path]:
    """The `eval_*.json` files in `folder` that are results of `plugformer eval` (a JSON object naming the `model` and
    the `split`), sorted; another tool's files of that name are no results."""
    found = []
    for path in sorted(Path(folder).glob("eval_*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(result, dict) and {"model", "split"} <= result.keys():
            found.append(path)
    return found


def foreign_checkpoints(folder: str | Path) -> list[str]:
    """The `checkpoint-<N>` folders in `folder` that plugformer did not publish, sorted: every one in a folder that
    holds no plugformer run (`recorded_stage`), else those without plugformer's manifest (`MANIFEST`)."""
    checkpoints = sorted(path for path in Path(folder).iterdir() if CHECKPOINT_NAME.match(path.name) and path.is_dir())
    ours = recorded_stage(folder)[0] is not None
    return [path.name for path in checkpoints if not ours or not (path / MANIFEST).is_file()]


def overwritten(folder: str | Path) -> list[Path]:
    """What `--overwrite_output_dir true` removes from `folder`: `plugformer eval`'s results, and in a folder of a
    plugformer run its records and claim (`REPLACED`, `run_info.json` first) and its checkpoints."""
    folder = Path(folder)
    results = eval_results(folder)
    if recorded_stage(folder)[0] is None:
        return results
    checkpoints = [path for path in sorted(folder.iterdir()) if CHECKPOINT_NAME.match(path.name) and path.is_dir()]
    records = [folder / name for name in REPLACED]
    # the finished record first, the claim last: a kill meanwhile leaves no record of a half-removed run, and the
    # folder still judged a plugformer run's
    return [path for path in [*records, *results, *checkpoints, folder / RUN_RECORD] if path.exists()]


def own_checkpoint(output_dir: str | Path, resume: str) -> bool:
    """Whether `--resume_from_checkpoint resume` resumes a checkpoint of `output_dir` (`last` always does)."""
    if str(resume).lower() in ("last", "true"):
        return True
    return Path(resume).resolve().parent == Path(output_dir).resolve()


def resume_problem(output_dir: str, resume: str, stage: str) -> str | None:
    """Why `--resume_from_checkpoint resume` cannot continue a `stage` run in `output_dir`, or `None`."""
    explicit = str(resume).lower() not in ("last", "true")
    folder = Path(resume).parent if explicit else Path(output_dir)
    found, source = recorded_stage(folder)
    if found is not None and found != stage:
        return (
            f"--resume_from_checkpoint {resume}: {folder} holds a {found!r} run ({source}), not a {stage!r} one; "
            f"resuming would continue its trainer state (optimizer, schedule, step) as stage {stage!r} and "
            f"rewrite its record. Choose a new --output_dir, or replace it with --overwrite_output_dir true "
            "(without --resume_from_checkpoint)"
        )
    finished = Path(output_dir, "run_info.json").is_file()
    if not explicit and finished and not any(p.is_dir() for p in Path(output_dir).glob("checkpoint-*")):
        return (
            f"--resume_from_checkpoint {resume}: nothing to resume in {output_dir}: its {found or stage!r} run "
            "finished (run_info.json) and saved no checkpoint, so a resume would train again from scratch over "
            "the finished model; choose a new --output_dir, or replace it with --overwrite_output_dir true"
        )
    return None


def occupied_problem(
    output_dir: str, resume: str | None, overwrite: bool, stage: str | None = None, resumable: bool = True
) -> str | None:
    """Why training `stage` into `output_dir` would destroy another run's work, or `None` (`resumable`: whether the
    command has `--resume_from_checkpoint` to suggest)."""
    output = Path(output_dir)
    if not str(output_dir).strip():
        return f"--output_dir {output_dir!r}: expected a folder path"
    if output.exists() and not output.is_dir():
        return f"--output_dir {output_dir} is an existing file, not a folder; choose a folder"
    existing = next(folder for folder in [output.absolute(), *output.absolute().parents] if folder.exists())
    if not existing.is_dir():
        return f"--output_dir {output_dir} is under {existing}, which is a file, not a folder; choose a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--output_dir {output_dir}: {existing} is not writable by this user; choose a folder you can write"
    own = resume is not None and own_checkpoint(output_dir, resume)
    if overwrite and own:
        return (
            f"--overwrite_output_dir true and --resume_from_checkpoint {resume} contradict each other: the "
            "overwrite removes the folder's checkpoints; resume the run in the folder, or overwrite it, not both"
        )
    problem = overwrite_problem(output_dir) if overwrite else None
    if problem is None and resume is not None and stage is not None:
        problem = resume_problem(output_dir, resume, stage)
    found = run_files(output)
    if problem is not None or not found or own or overwrite:
        return problem
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    if resume is not None:  # another folder's checkpoint
        return (
            f"--resume_from_checkpoint {resume}: the checkpoint is of another folder ({Path(resume).parent}), "
            f"and --output_dir {output_dir} holds another run ({shown}), whose model and records the resumed "
            "run would replace; resume into a new or empty --output_dir, or replace that run with "
            "--overwrite_output_dir true"
        )
    resume_it = "resume that run with --resume_from_checkpoint last, " if resumable else ""
    return (
        f"--output_dir {output_dir} already holds another run ({shown}); choose a new folder, {resume_it}or "
        "replace it with --overwrite_output_dir true"
    )


def overwrite_problem(output_dir: str) -> str | None:
    """Why `--overwrite_output_dir true` must not replace the run in `output_dir`: it holds `checkpoint-*` folders
    that plugformer did not publish (`foreign_checkpoints`), which the overwrite would neither remove nor keep apart
    from the new run's."""
    foreign = foreign_checkpoints(output_dir) if Path(output_dir).is_dir() else []
    if not foreign:
        return None
    shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
    why = "the folder holds no plugformer run" if recorded_stage(output_dir)[0] is None else f"no {MANIFEST}"
    return (
        f"--overwrite_output_dir true: {output_dir} holds {shown}, which plugformer did not write ({why}); "
        "the overwrite removes only plugformer's files. Move or delete them yourself, or choose a new "
        "--output_dir"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def acquire_lock(output_dir: str | Path) -> str | None:
    """Creates `<output_dir>/.plugformer.lock` for this process; returns why not (a live run holds it), or `None`.

    The lock holds the pid, host and start time. One held by a dead process on this host, or unreadable (torn by a
    kill), is taken over with a warning; one held by this very process (an earlier run in it that raised) silently.
    Judging a lock and replacing it is one step: takers hold an exclusive `flock` on `TAKEOVER` meanwhile, so of two
    processes that both found the same stale lock, the second sees the first one's live lock.
    """
    path = Path(output_dir, LOCK)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with _one_taker_at_a_time(Path(output_dir, TAKEOVER)):
        for _ in range(3):
            try:
                descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                problem = _judge_holder(path, mine, output_dir)
                if problem is not None:
                    return problem
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(descriptor, "w") as handle:
                handle.write(json.dumps(mine) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            atexit.register(release_lock, str(output_dir))
            return None
    return f"--output_dir {output_dir}: could not take {path} (another process keeps creating it)"


def _judge_holder(path: Path, mine: dict, output_dir) -> str | None:
    """Why the lock at `path` must be left alone (a live holder), or `None` (stale: warned about, to be replaced)."""
    try:
        holder = json.loads(path.read_text())
        pid, host = int(holder["pid"]), str(holder["host"])
    except FileNotFoundError:
        return None  # released meanwhile
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning("%s is unreadable (torn by a kill?); taking it over", path)
        return None
    if host != mine["host"]:
        return (
            f"--output_dir {output_dir} is locked by pid {pid} on host {host} (since {holder.get('started')}); "
            f"if no run is live there, delete {path}"
        )
    if pid != mine["pid"] and _alive(pid):
        return (
            f"--output_dir {output_dir} is in use by a live run (pid {pid}, since {holder.get('started')}); wait "
            f"for it or choose another folder (if pid {pid} is no plugformer run, delete {path})"
        )
    if pid != mine["pid"]:
        logger.warning("%s was left by pid %d, which is no longer running; taking it over", path, pid)
    return None


@contextlib.contextmanager
def _one_taker_at_a_time(guard: Path):
    """An exclusive `flock` on `guard` (created if need be) for the block; the kernel releases it if the holder
    dies, so it never goes stale. Where `fcntl` is missing (Windows) the block runs unguarded."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    descriptor = os.open(guard, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the flock


def release_lock(output_dir: str | Path) -> None:
    """Removes the lock if this process holds it."""
    path = Path(output_dir, LOCK)
    try:
        if int(json.loads(path.read_text())["pid"]) == os.getpid():
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        pass


def take_over(output_dir: str, overwrite: bool, stage: str | None) -> None:
    """With `overwrite`, removes what plugformer wrote of the other run (`overwritten`); records `stage` as the
    folder's (`RUN_RECORD`)."""
    if overwrite:
        replaced = overwritten(output_dir)
        if replaced:
            logger.warning(
                "--overwrite_output_dir true: removing %s from %s", sorted(p.name for p in replaced), output_dir
            )
        for path in replaced:
            _remove(path)
    if stage is not None:
        write_json_atomic(Path(output_dir, RUN_RECORD), {"stage": stage})


def _remove(path: Path) -> None:
    if CHECKPOINT_NAME.match(path.name):
        retire(path)  # renamed out of sight first: no half-deleted checkpoint-N
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def retire(checkpoint: Path) -> None:
    """Deletes a checkpoint directory after renaming it into the staging area, so it vanishes in one step."""
    trash = checkpoint.parent / STAGING / f"retired-{checkpoint.name}"
    trash.parent.mkdir(exist_ok=True)
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(checkpoint, trash)
    fsync(checkpoint.parent)
    shutil.rmtree(trash, ignore_errors=True)


def fsync(path: Path) -> None:
    """Flushes a file, or a directory entry, to disk (directories cannot be opened for writing on every OS)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    try:
        descriptor = os.open(path, flags)
    except OSError:  # e.g. directories on Windows
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def begin_run(output_dir: str | Path, stage: str) -> None:
    """Marks the run in `output_dir` in progress (`RUN_RECORD`) and removes the records of a finished run there
    (`RECORDS`, `run_info.json` first, and `plugformer eval`'s results), before training writes anything: until
    `finish_run`, no reader takes them for the model this run saves. Main process only."""
    folder = Path(output_dir)
    write_json_atomic(folder / RUN_RECORD, {"stage": stage, "status": IN_PROGRESS})
    stale = [path for path in [*(folder / name for name in RECORDS), *eval_results(folder)] if path.exists()]
    if stale:
        logger.warning(
            "%s: removing %s of the finished run it replaces; this run writes its own when it finishes",
            output_dir,
            [path.name for path in stale],
        )
    for path in stale:
        path.unlink(missing_ok=True)


def finish_run(output_dir: str | Path, stage: str) -> None:
    """Marks the run in `output_dir` finished (`RUN_RECORD`), once its `run_info.json` is written. Main process
    only."""
    write_json_atomic(Path(output_dir, RUN_RECORD), {"stage": stage, "status": FINISHED})


@contextlib.contextmanager
def interrupted_run(output_dir: str | Path, stage: str):
    """Turns Ctrl-C in the block (from `begin_run` to the `run_info.json` write) into a `KeyboardInterrupt` whose
    message says what the folder holds and how to go on (the CLI prints it as one line)."""
    try:
        yield
    except KeyboardInterrupt:
        if Path(output_dir, "run_info.json").is_file():  # interrupted after the run finished
            raise
        raise KeyboardInterrupt(
            f"stage {stage!r} interrupted before it finished: {output_dir} holds no run_info.json ({RUN_RECORD} says "
            "in progress), so its model files are no finished run; continue it with --resume_from_checkpoint last, "
            "or train again with --overwrite_output_dir true"
        ) from None


def claim_folder(output_dir: str, stage: str, overwrite: bool = False) -> None:
    """`claim_output_dir` for a single-process command that writes a model (`demo`, `convert`): refuses a folder
    holding another run unless `overwrite`, locks it (`release_lock` when done) and records `stage`.

    The folder is judged again once locked: a run that finished into it between the first look and the lock (its
    lock released meanwhile) is refused too, so that two claimers never both find it free."""
    problem = occupied_problem(output_dir, None, overwrite, stage, resumable=False) or acquire_lock(output_dir)
    if problem is None:
        problem = occupied_problem(output_dir, None, overwrite, stage, resumable=False)
        if problem is not None:
            release_lock(output_dir)
    if problem is not None:
        raise ValueError(problem)
    take_over(output_dir, overwrite, stage)


@contextlib.contextmanager
def claimed_folder(output_dir: str, stage: str, overwrite: bool = False):
    """`claim_folder` for the block, unlocked when it ends. If the block raises, what the claim and the block added
    to the folder (the record, the lock, partly written files) is removed first, so that a retry is not refused as
    a folder holding another run: it finds the folder as it was, less what `overwrite` had already removed.

    For commands whose whole output is written inside the block (`convert`); files that existed before the claim
    are left as they are (the claim only ran because they were no run, or `overwrite` allowed replacing them)."""
    folder = Path(output_dir)
    before = set(os.listdir(folder)) if folder.is_dir() else set()
    claim_folder(output_dir, stage, overwrite)
    try:
        yield
    except BaseException:
        # the flock guard stays: another taker may hold it open, and a new file would let two take over at once
        added = [path for path in folder.iterdir() if path.name not in before and path.name not in (LOCK, TAKEOVER)]
        for path in [*added, folder / RUN_RECORD]:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        logger.warning(
            "%s failed: removed %s from %s", stage, sorted({p.name for p in added} | {RUN_RECORD}), output_dir
        )
        raise
    finally:
        release_lock(output_dir)
