"""Small C drivers around the project's kernel sources, for tests that call their static functions directly."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from plugformer import native


def build_driver(folder: Path, source: str, march: str | None = None) -> ctypes.CDLL:
    """Builds `source` (C that includes `csrc/` headers or sources) in `folder` with the kernels' flags (their
    `-march` replaced by `march` where given; the simd pragmas on, as in `native.build`) and loads it; raises
    `RuntimeError` with the compiler's output where it fails."""
    command = native.compiler()
    if command is None:
        raise RuntimeError("no C compiler")
    flags = [flag for flag in native.FLAGS if march is None or not flag.startswith("-march")]
    (folder / "driver.c").write_text(source)
    argv = [*command, *flags, *([f"-march={march}"] if march else []), *native.THREADING[1], f"-I{native.SOURCES}"]
    built = subprocess.run(
        [*argv, str(folder / "driver.c"), "-o", str(folder / "driver.so"), "-lm"], capture_output=True, text=True
    )
    if built.returncode != 0:
        raise RuntimeError(built.stderr[-300:])
    return ctypes.CDLL(str(folder / "driver.so"))
