"""`accelerate launch tests/fused_loss_worker.py CALLS_DIR <stage> ARGS...`: `plugformer train <stage>` with its fused
losses counted on each rank, for tests/test_fused_loss_distributed.py.

Counted are the training calls (gradient on) of plugformer's fused head (`plugformer.losses.linear_cross_entropy`, what
`train pretrain --fused_loss true` runs) and of TRL's (`trl.trainer.utils._ChunkedLogProbFunction`, what `train sft
--fused_loss true` runs); each rank writes its counts to `CALLS_DIR/rank<RANK>.json` after training."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import plugformer.losses
from plugformer.training import run_stage


CALLS = {"plugformer": 0, "trl": 0}


def counted(function, key: str):
    def call(*args, **kwargs):
        CALLS[key] += torch.is_grad_enabled()  # training; evaluation and scoring run without a gradient
        return function(*args, **kwargs)

    return call


def count_fused_calls() -> None:
    import trl.trainer.utils

    plugformer.losses.linear_cross_entropy = counted(plugformer.losses.linear_cross_entropy, "plugformer")
    chunked = trl.trainer.utils._ChunkedLogProbFunction  # a global of `add_fused_lm_head`'s forward, looked up per call

    class Counted(chunked):
        apply = staticmethod(counted(chunked.apply, "trl"))

    trl.trainer.utils._ChunkedLogProbFunction = Counted


if __name__ == "__main__":
    calls_dir = Path(sys.argv[1])
    count_fused_calls()
    run_stage(sys.argv[2], sys.argv[3:])
    calls_dir.mkdir(parents=True, exist_ok=True)
    (calls_dir / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(CALLS))
