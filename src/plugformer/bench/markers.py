"""The marker lines around the generated performance block (`plugformer.runtime.markers`' block `bench`) of the
benchmarks page, `model_cards/BENCHMARKS.md` (`PAGE`), checked before a bench run and rewritten after it.

Below both `arguments` (which checks a `--readme` before measuring) and `readme` (which writes the block): neither
imports the other for it.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.markers import check_block, markers, write_blocks


BLOCK = "bench"
BEGIN, END = markers(BLOCK)
PAGE = "model_cards/BENCHMARKS.md"  # the project's page with the block (and `bench-variants`), from the repo root


def check_markers(readme_path: str | Path) -> None:
    """Raises a ValueError naming `readme_path` unless it has the markers in order (before a long run, not after)."""
    check_block(readme_path, BLOCK)


def update_readme(readme_path: str | Path, section: str) -> None:
    """Replaces what lies between the marker lines of `readme_path` with `section`, keeping the markers and every
    other byte; written to a temporary file beside it, then moved over it (a reader never sees half a file)."""
    write_blocks(readme_path, {BLOCK: section})
