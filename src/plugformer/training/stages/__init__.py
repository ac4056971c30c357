"""The shipped training stages, one module each: its script arguments, its `train` function and the `Stage` record
it registers in the stage table (`training/stage_table.py`).

Importing this package registers them in `STAGE_MODULES` order, the pipeline's default order. A stage module
imports TRL only inside its `train` function, so `plugformer train --help` lists the stages without loading TRL.
"""

from __future__ import annotations

import importlib


# the modules that register the shipped stages, in the pipeline's default order: a parent before its children
STAGE_MODULES = ("pretrain", "sft", "reward", "rlhf", "dpo", "grpo", "rft", "sft_matched", "classify", "seq2seq", "nli")
for _module in STAGE_MODULES:
    importlib.import_module(f".{_module}", __name__)
