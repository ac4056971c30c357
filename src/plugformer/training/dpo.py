"""Direct preference optimisation with TRL's `DPOTrainer` (Rafailov et al. 2023) on preference pairs; the
reference model is the starting (SFT) model, rebuilt by TRL from its directory or, with LoRA, the adapter-free
base."""

from __future__ import annotations

from transformers import AutoModelForCausalLM
from trl import DPOTrainer

from .common import run_trainer


def train(script_args, model_args, training_args) -> dict:
    # the reference and beta make the saved policy a reward model too (`implicit_reward`, the rlhf stage's
    # --reward_model_path); with LoRA the reference is the adapter-free base, the same directory
    implicit = {"reference": model_args.model_name_or_path, "beta": training_args.beta}
    return run_trainer("dpo", DPOTrainer, AutoModelForCausalLM, script_args, model_args, training_args, extra=implicit)
