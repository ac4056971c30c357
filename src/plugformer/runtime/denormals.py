"""Flush-to-zero for the command line's processes: x86 CPUs (Intel's most) compute on subnormal floats (below 1.2e-38
in fp32) through microcode assists, tens of times slower than on normal ones, and attention with a position bias makes
them in bulk: exp(score + bias − lse) of the keys a large bias pushes far down, and every product with those weights
(on an Intel Xeon they halved ALiBi's training speed; AMD's EPYC runs them at full speed: BENCHMARKS.md, "Design
measurements").

Flushing (FTZ and DAZ, `torch.set_flush_denormal`) reads and writes those numbers as 0: a weight below 1.2e-38 beside
the row's largest, 1, which no fp32 sum can register, as GPU attention kernels do. The mode belongs to each thread and
a thread pool's threads copy it when they start, so the command line sets it before any work (`cli.main`), and
library code never sets it: a user's own process decides (`torch.set_flush_denormal(True)` before the first
operation). `PLUGFORMER_FLUSH_DENORMAL=0` keeps subnormals in the command line too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .flags import environment_flag


VARIABLE = "PLUGFORMER_FLUSH_DENORMAL"


def denormals_flushed() -> bool:
    """Whether this thread flushes subnormal floats to zero: 1e-39 (subnormal in fp32) times 1 reads 0."""
    return torch.tensor([1e-39], dtype=torch.float32).mul(1.0).item() == 0.0


@contextlib.contextmanager
def flushing_denormals() -> Iterator[bool]:
    """Flush subnormals to zero inside the block unless `PLUGFORMER_FLUSH_DENORMAL` is 0 / false / no (or the CPU
    cannot); the mode before it is restored after. Yields whether the block flushes."""
    before = denormals_flushed()
    flushing = before or (environment_flag(VARIABLE, default=True) and torch.set_flush_denormal(True))
    try:
        yield flushing
    finally:
        if flushing and not before:
            torch.set_flush_denormal(False)
