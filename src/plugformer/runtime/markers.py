"""Generated blocks of a markdown file: the text between the lines `<!-- NAME:begin -->` and `<!-- NAME:end -->`, read,
checked and rewritten in place, every byte outside the blocks kept.

README.md has two, `variants` and `kernels` (`readme_tables`, from the registries and the kernel records);
`model_cards/BENCHMARKS.md` has `bench` and `bench-variants` (`bench.readme`, from `bench.json` files).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The begin and end lines of block `name`."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _span(text: str, path: str | Path, name: str) -> tuple[int, int]:
    """Where block `name` lies in `text`: after its begin marker, up to its end marker."""
    begin_line, end_line = markers(name)
    counts = {marker: text.count(marker) for marker in (begin_line, end_line)}
    if counts != {begin_line: 1, end_line: 1}:
        raise ValueError(
            f"{path}: expected one line {begin_line} and one line {end_line}, found {counts[begin_line]} "
            f"and {counts[end_line]}"
        )
    begin, end = text.index(begin_line) + len(begin_line), text.index(end_line)
    if end < begin:
        raise ValueError(f"{path}: {end_line} comes before {begin_line}")
    return begin, end


def check_block(path: str | Path, name: str) -> None:
    """Raises a `ValueError` naming `path` unless it has block `name`'s markers, once each and in order."""
    _span(Path(path).read_text(encoding="utf-8"), path, name)


def read_block(path: str | Path, name: str) -> str:
    """The text of block `name` in `path`, without the newlines that separate it from its markers."""
    text = Path(path).read_text(encoding="utf-8")
    begin, end = _span(text, path, name)
    return text[begin:end].strip("\n")


def write_blocks(path: str | Path, sections: dict[str, str]) -> None:
    """Replaces the text of each block `name` of `path` with `sections[name]`, keeping the markers and every other
    byte; written to a temporary file beside it, then moved over it (a reader never sees half a file)."""
    path = Path(path)
    text = path.read_bytes().decode("utf-8")
    for name, section in sections.items():
        begin, end = _span(text, path, name)
        if any(marker in section for marker in markers(name)):
            raise ValueError(f"{path}: the section must not contain the markers {' / '.join(markers(name))}")
        text = text[:begin] + "\n" + section.strip("\n") + "\n" + text[end:]
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as output:
            output.write(text.encode("utf-8"))
            output.flush()
            os.fsync(output.fileno())
        os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))  # mkstemp creates 0600
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
