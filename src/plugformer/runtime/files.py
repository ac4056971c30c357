"""Files written whole or not at all: a kill or a full disk mid-write leaves the previous version, never a torn one.

A torn `run_info.json` would break every later pipeline run: state files are written to a temporary file in
the same folder, flushed to disk, and renamed over the target (`os.replace` is atomic within a file system). The
file gets the mode a plain `open` would give it (`0o666` less the umask), not the temporary file's 0600, so that a
model folder or a cache shared by a group stays readable; `with_umask_mode` does the same for other such writers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# the same two errors as text: libc's strerror, and Rust's io::ErrorKind inside safetensors' SafetensorError
OUT_OF_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "StorageFull", "QuotaExceeded")
# torch.save reports a short write without its errno; read as a full disk only when the disk is (nearly) full
TORCH_WRITE_FAILED = "PytorchStreamWriter failed writing file"
TORCH_FULL_MARGIN = 64 * 2**20


class DiskFullError(OSError):
    """Writing `filename` ran out of disk space (ENOSPC) or quota (EDQUOT); the message says what was written, the
    space free and what is intact. The CLI prints it as one line."""


def free_space(path: str | Path) -> tuple[int, Path]:
    """(bytes free to this user, the folder measured) on the file system holding `path` (its nearest existing
    parent)."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free, folder


def size_text(count: float) -> str:
    """
    >>> size_text(0), size_text(1536), size_text(3 * 2**30)
    ('0 B', '1.5 KiB', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def is_out_of_space(error: BaseException, path: str | Path) -> bool:
    """Whether `error`, raised while writing under `path`, means the disk (or quota) is full: an `OSError` with
    ENOSPC/EDQUOT, that error's text in another exception (safetensors), or torch's short write when under
    `TORCH_FULL_MARGIN` bytes are free. Nothing broader."""
    if isinstance(error, OSError) and error.errno in OUT_OF_SPACE_ERRNOS:
        return True
    text = str(error)
    if any(part in text for part in OUT_OF_SPACE_TEXT):
        return True
    return TORCH_WRITE_FAILED in text and free_space(path)[0] < TORCH_FULL_MARGIN


@contextlib.contextmanager
def naming_a_full_disk(path: str | Path, what: str, intact: str | Callable[[], str] = "") -> Iterator[None]:
    """Turns an out-of-space error inside the block (`is_out_of_space`) into one `DiskFullError` line: `what` was
    written to `path`, the disk is full, how much is free, and `intact` (what the failed write left whole, a
    string or a function called after the failure). Any other error passes unchanged; a `DiskFullError` of an inner
    write is named again by the outer block, which knows what the write was part of."""
    try:
        yield
    except Exception as error:
        if not is_out_of_space(error, path):
            raise
        raise disk_full(path, what, intact() if callable(intact) else intact, error) from error


def disk_full(path: str | Path, what: str, intact: str, cause: BaseException) -> DiskFullError:
    free, folder = free_space(path)
    reason = "disk quota exceeded" if getattr(cause, "errno", None) == errno.EDQUOT else "No space left on device"
    message = (
        f"writing {what} to {path}: the disk is full ({reason}); {size_text(free)} free on the file system of "
        f"{folder}" + (f"; {intact}" if intact else "")
    )
    return DiskFullError(getattr(cause, "errno", None) or errno.ENOSPC, message)


def looks_local(source: str | Path) -> bool:
    """Whether `source` can only be a local path, never a Hub id (`org/name`): absolute, starting with `.` or `~`, or
    holding a backslash or more than one `/`.

    >>> looks_local("./llama"), looks_local("~/m"), looks_local("a/b/c"), looks_local("meta-llama/Llama-3.2-1B")
    (True, True, True, False)
    """
    text = str(source)
    return Path(text).is_absolute() or text.startswith((".", "~")) or "\\" in text or text.count("/") > 1


def model_source_problem(source: str) -> str | None:
    """Why `source` names no model (or tokenizer) that can be loaded here, or None: a local path that is a file or
    does not exist, or, read as a Hub id, an invalid one or (offline) one without a copy in the local cache. What a
    model option says in one line before any work, instead of transformers' `OSError` traceback."""
    path = Path(source).expanduser()
    if path.is_dir():  # a saved model, or a PEFT adapter over one
        if any((path / name).is_file() for name in ("config.json", "adapter_config.json")):
            return None
        return f"{source} holds no config.json, so it is no saved model (the folder save_pretrained writes)"
    if path.exists():
        return f"{source} is a file, not a model folder"
    if looks_local(source):
        return f"{source} does not exist (no such folder)"
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        return f"{source!r} is neither a local folder nor a Hub id (org/name: letters, digits, '-', '_', '.')"
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(source, "config.json"), str):
        return (
            f"{source} is no local folder, and as a Hub id it is not in the local cache while the Hub is offline "
            "(plugformer sets HF_HUB_OFFLINE=1 unless you set it; HF_HUB_OFFLINE=0 downloads)"
        )
    return None


def nearest_existing(path: str | Path) -> Path:
    """`path` made absolute, or its nearest parent that exists."""
    path = Path(path).expanduser().absolute()
    return next(folder for folder in [path, *path.parents] if folder.exists())


def folder_problem(path: str | Path) -> str | None:
    """Why `path` cannot be a folder (a file, or under a file), or None: what a folder-valued option says in one
    line, before any work, instead of a `NotADirectoryError` when the first file is written into it.

    >>> folder_problem("/dev/null")
    '/dev/null is a file, not a folder'
    """
    existing = nearest_existing(path)
    if existing.is_dir():
        return None
    shown = Path(path).expanduser().absolute()
    if existing == shown:
        return f"{path} is a file, not a folder"
    return f"{path} is under {existing}, which is a file, not a folder"


def writable_folder_problem(path: str | Path) -> str | None:
    """Why files cannot be written into the folder `path` (made if missing) by this process, or None: `folder_problem`,
    or its nearest existing folder is not writable (`os.access`: also false on a read-only file system)."""
    problem = folder_problem(path)
    if problem is not None:
        return problem
    existing = nearest_existing(path)
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None


def current_umask(default: int = 0o022) -> int:
    """The process umask, read without changing it (`/proc/self/status`, Linux); elsewhere set and restored at once,
    or `default` where neither works."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    try:
        current = os.umask(0o022)
        os.umask(current)
        return current
    except (OSError, NotImplementedError):  # pragma: no cover - no umask on this platform
        return default


def umask_mode() -> int:
    """The mode a plain `open(path, "w")` gives a new file: `0o666` less the umask (0644 under umask 022)."""
    return 0o666 & ~current_umask()


def with_umask_mode(*paths: str | Path) -> None:
    """Gives each file the umask's mode (`umask_mode`): writers that go through a temporary file (`mkstemp`,
    safetensors' `save_file` since 0.8) leave it 0600, unreadable to a group sharing the folder."""
    mode = umask_mode()
    for path in paths:
        os.chmod(path, mode)


def weights_with_umask_mode(folder: str | Path) -> None:
    """`with_umask_mode` for the safetensors files at the top of `folder`, after a `save_pretrained` into it."""
    with_umask_mode(*Path(folder).glob("*.safetensors"))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes `text` (UTF-8) to `path` through a temporary sibling file, fsync and `os.replace`, with the umask's
    mode (`umask_mode`); a full disk raises `DiskFullError` with the previous file intact."""
    path = Path(path)
    intact = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
    descriptor, temporary = None, None
    try:
        with naming_a_full_disk(path, path.name, intact):
            descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temporary, umask_mode())  # mkstemp creates 0600; a plain open gives the umask's mode
            os.replace(temporary, path)
    except BaseException:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        raise
    try:  # the rename itself reaches the disk with the directory entry
        directory = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # directories cannot be opened on every OS
        return
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_json_atomic(path: str | Path, value: Any, **dumps: Any) -> None:
    """`json.dumps(value, **dumps)` plus a newline, written with `write_text_atomic`."""
    write_text_atomic(path, json.dumps(value, **dumps) + "\n")


# the weight files a saved model folder holds at its top level (not its checkpoints, nor adapter/)
WEIGHT_FILES = ("model*.safetensors", "pytorch_model*.bin")
# what else of a saved model folder changes its outputs: the architecture and its fields, the generation defaults
# (eos and pad ids end and pad `generate()`'s answers), the tokenizer (not results, records or caches kept beside them)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer*.json", "special_tokens_map.json",
               "chat_template.jinja", "vocab.*", "merges.txt", "*.model")  # fmt: skip


def files_sha256(folder: str | Path, patterns: tuple[str, ...]) -> str | None:
    """The sha256 of the files matching `patterns` at the top of `folder` (names and bytes, in sorted order), or
    None when none matches."""
    import hashlib

    files = sorted({path for pattern in patterns for path in Path(folder).glob(pattern) if path.is_file()})
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(2**24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def weights_sha256(folder: str | Path) -> str | None:
    """The sha256 of the weight files at the top of a saved model folder (names and bytes, in sorted order), or None
    when it holds none: equal digests, the same weights. Consumers of a run (pipeline reuse, compare's score cache, a
    DPO stage's reference) compare it with the digest recorded when the run was made."""
    return files_sha256(folder, WEIGHT_FILES)


def model_sha256(folder: str | Path) -> dict[str, str | None]:
    """What a saved model folder's scores depend on, as digests: its weights (`weights_sha256`) and the config,
    generation defaults and tokenizer beside them (`MODEL_FILES`). The key of a cached score: equal digests, the
    same model."""
    return {"weights_sha256": weights_sha256(folder), "model_files_sha256": files_sha256(folder, MODEL_FILES)}


def portable_path(path: str | Path, folder: str | Path) -> str:
    """`path` as a record written in `folder` holds it: never an absolute path into the user's home folder, which
    names the user and leaks when the folder is shared. Relative to `folder` when `path` is inside it (`"."` for
    `folder` itself) or when both are inside the home folder; else `~/...` when `path` alone is; else absolute.
    `recorded_path` reads it back.

    >>> portable_path("/srv/runs/sft", "/srv/runs/sft"), portable_path("/srv/runs/sft", "/srv/runs")
    ('.', 'sft')
    """
    target, base = Path(path).expanduser().resolve(), Path(folder).expanduser().resolve()
    try:
        home = Path.home().resolve()
    except RuntimeError:  # no HOME and no passwd entry: nothing to hide
        home = None
    in_home = home is not None and target.is_relative_to(home)
    if target.is_relative_to(base) or (in_home and base.is_relative_to(home)):
        return Path(os.path.relpath(target, base)).as_posix()
    if in_home:
        return Path("~", target.relative_to(home)).as_posix()
    return target.as_posix()


def recorded_path(recorded: str | Path, folder: str | Path) -> Path:
    """The absolute path a record in `folder` names with `recorded` (`portable_path`'s inverse; an absolute
    `recorded`, as earlier versions wrote, is taken as it is)."""
    named = Path(recorded).expanduser()
    return (named if named.is_absolute() else Path(folder, named)).resolve()
