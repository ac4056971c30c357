"""How the tests' torchrun workers end, once their results are written: every rank past a barrier, the process group
destroyed, then out without the interpreter's finalization.

FSDP2's state keeps the (destroyed) gloo group referenced until the interpreter tears the modules down; 1 run in 18-28
of tests/selection_fsdp_worker.py then aborted there ("terminate called without an active exception", exit -6, no
Python frame), after its work and its result file were complete, and failed a test that had nothing wrong to report.
pytorch/pytorch#179291 describes the mechanism (gloo's objects destroyed during finalization)."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def finish() -> None:
    """Barrier, destroy the process group, flush, and exit 0 without finalization (`os._exit`)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
