"""An output folder belongs to one run: a second run into it, or a second live process, is refused before training.

transformers 5.24's `TrainingArguments` no longer has `overwrite_output_dir`: a run into a folder that holds another
run's model and checkpoints overwrites the model, and the checkpoint rotation then keeps whichever `checkpoint-N` has
the highest step — possibly the other run's, which `--resume_from_checkpoint last` would later resume inside this
one. `claim_output_dir` refuses such a folder unless the run resumes (`--resume_from_checkpoint`) or says
`--overwrite_output_dir true` (then the other run's checkpoints and records are removed first), and takes a
lock file against a second live run in the same folder. A lock whose process is dead (a killed run) is taken over
with a warning.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import time
from pathlib import Path

from .checkpoints import _CHECKPOINT, PROGRESS, retire


logger = logging.getLogger(__name__)

LOCK = ".plugformer.lock"
# what a finished or interrupted run leaves in its folder (TensorBoard's runs/ and a README alone are no model)
# removed by --overwrite_output_dir beside the checkpoints: the other run's record and the step it reached
REPLACED = ("run_info.json", "trainer_state.json", PROGRESS)
RUN_FILES = ("run_info.json", "trainer_state.json", "config.json", "*.safetensors", "checkpoint-*", "adapter")


def run_files(output_dir: str | Path) -> list[str]:
    """The names in `output_dir` that belong to a run (`RUN_FILES`), sorted."""
    output = Path(output_dir)
    if not output.is_dir():
        return []
    return sorted({path.name for pattern in RUN_FILES for path in output.glob(pattern)})


def occupied_problem(output_dir: str, resume: str | None, overwrite: bool) -> str | None:
    """Why training into `output_dir` would destroy another run's work, or `None`."""
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        return f"--output_dir {output_dir} is an existing file, not a folder; choose a folder"
    if overwrite and resume is not None:
        return (f"--overwrite_output_dir true and --resume_from_checkpoint {resume} contradict each other: "
                "resume the run in the folder, or overwrite it, not both")  # fmt: skip
    found = run_files(output)
    if not found or resume is not None or overwrite:
        return None
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    return (f"--output_dir {output_dir} already holds another run ({shown}); choose a new folder, resume that run "
            "with --resume_from_checkpoint last, or replace it with --overwrite_output_dir true")  # fmt: skip


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
    """
    path = Path(output_dir, LOCK)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for _ in range(3):  # a stale lock is removed, then created again exclusively: of two takers one wins
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                pid, host = int(holder["pid"]), str(holder["host"])
            except (OSError, ValueError, KeyError, TypeError):
                logger.warning("%s is unreadable (torn by a kill?); taking it over", path)
            else:
                if host != mine["host"]:
                    return (f"--output_dir {output_dir} is locked by pid {pid} on host {host} (since "
                            f"{holder.get('started')}); if no run is live there, delete {path}")  # fmt: skip
                if pid != mine["pid"] and _alive(pid):
                    return (f"--output_dir {output_dir} is in use by a live run (pid {pid}, since "
                            f"{holder.get('started')}); wait for it or choose another folder (if pid {pid} is no "
                            f"plugformer run, delete {path})")  # fmt: skip
                if pid != mine["pid"]:
                    logger.warning("%s was left by pid %d, which is no longer running; taking it over", path, pid)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(descriptor, "w") as handle:
            handle.write(json.dumps(mine) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        atexit.register(release_lock, str(output_dir))
        return None
    return f"--output_dir {output_dir}: could not take {path} (another process keeps creating it)"


def release_lock(output_dir: str | Path) -> None:
    """Removes the lock if this process holds it."""
    path = Path(output_dir, LOCK)
    try:
        if int(json.loads(path.read_text())["pid"]) == os.getpid():
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        pass


def claim_output_dir(script_args, training_args) -> None:
    """Refuses an occupied or locked `output_dir` on every rank together (`ValueError`), else locks it (main
    process) and, with `--overwrite_output_dir true`, removes the other run's checkpoints and records (`REPLACED`).

    Call before any work: the check reads only the folder. A collective (every rank's verdict is gathered), so that
    no rank trains on while another refuses.
    """
    from .distributed import gather_from_ranks

    output_dir, resume = training_args.output_dir, training_args.resume_from_checkpoint
    overwrite = bool(getattr(script_args, "overwrite_output_dir", False))
    main = training_args.process_index == 0
    problem = occupied_problem(output_dir, resume, overwrite)
    locked = False
    if problem is None and main:
        problem = acquire_lock(output_dir)
        locked = problem is None
    first = next((p for p in gather_from_ranks(problem) if p), None)
    if first is not None:
        if locked:
            release_lock(output_dir)
        raise ValueError(first)
    if overwrite and main:
        replaced = [p for p in Path(output_dir).iterdir() if _CHECKPOINT.match(p.name) or p.name in REPLACED]
        if replaced:
            logger.warning("--overwrite_output_dir true: removing %s from %s", sorted(p.name for p in replaced),
                           output_dir)  # fmt: skip
        for path in replaced:
            retire(path) if path.is_dir() else path.unlink()
