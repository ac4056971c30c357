"""Direct preference optimisation with TRL's `DPOTrainer` (Rafailov et al. 2023) on preference pairs; the
reference model is the starting (SFT) model, rebuilt by TRL from its directory or, with LoRA, the adapter-free
base."""

from __future__ import annotations

from transformers import AutoModelForCausalLM
from trl import DPOTrainer

from .common import run_trainer


def train(script_args, model_args, training_args) -> dict:
    return run_trainer("dpo", DPOTrainer, AutoModelForCausalLM, script_args, model_args, training_args)
