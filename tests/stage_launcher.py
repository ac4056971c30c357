"""`accelerate launch tests/stage_launcher.py <stage> ARGS...`: `plugformer train <stage>` with one extra verifiable
reward, `length` (completion length): an untrained policy never answers right, so exact match would give every
GRPO group zero advantage and a few-step run nothing to learn (tests/test_training.py's `length_reward` does the
same in-process)."""

from __future__ import annotations

import sys

from plugformer.evaluation import rewards
from plugformer.training import run_stage


rewards.REWARD_FUNCTIONS["length"] = lambda completions, **kwargs: [
    float(len(rewards.completion_text(c))) for c in completions
]

if __name__ == "__main__":
    run_stage(sys.argv[1], sys.argv[2:])
