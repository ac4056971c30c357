"""The marker lines around the README's generated performance block, checked before a bench run and rewritten
after it.

Below both `arguments` (which checks a `--readme` before measuring) and `readme` (which writes the block): neither
imports the other for it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _block(text: str, path: str | Path) -> tuple[int, int]:
    """Where the generated block lies in `text`: after the begin marker, up to the end marker."""
    counts = {marker: text.count(marker) for marker in (BEGIN, END)}
    if counts != {BEGIN: 1, END: 1}:
        raise ValueError(f"{path}: expected one line {BEGIN} and one line {END}, found {counts[BEGIN]} and "
                         f"{counts[END]}")  # fmt: skip
    begin, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    if end < begin:
        raise ValueError(f"{path}: {END} comes before {BEGIN}")
    return begin, end


def check_markers(readme_path: str | Path) -> None:
    """Raises a ValueError naming `readme_path` unless it has the markers in order (before a long run, not after)."""
    _block(Path(readme_path).read_text(encoding="utf-8"), readme_path)


def update_readme(readme_path: str | Path, section: str) -> None:
    """Replaces what lies between the marker lines of `readme_path` with `section`, keeping the markers and every
    other byte; written to a temporary file beside it, then moved over it (a reader never sees half a file)."""
    path = Path(readme_path)
    text = path.read_bytes().decode("utf-8")
    begin, end = _block(text, path)
    if BEGIN in section or END in section:
        raise ValueError(f"{path}: the section must not contain the markers {BEGIN} / {END}")
    updated = text[:begin] + "\n" + section.strip("\n") + "\n" + text[end:]
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as output:
            output.write(updated.encode("utf-8"))
            output.flush()
            os.fsync(output.fileno())
        os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))  # mkstemp creates 0600
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
