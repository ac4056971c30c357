"""Files written whole or not at all: a kill or a full disk mid-write leaves the previous version, never a torn one.

A torn `run_info.json` broke every later pipeline run (issue 18): state files are written to a temporary file in
the same folder, flushed to disk, and renamed over the target (`os.replace` is atomic within a file system).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes `text` (UTF-8) to `path` through a temporary sibling file, fsync and `os.replace`."""
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
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
