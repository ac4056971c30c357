"""Supervised fine-tuning with TRL's `SFTTrainer`: conversations through the model's chat template, loss on the
completion (the assistant's answer) only."""

from __future__ import annotations

from transformers import AutoModelForCausalLM
from trl import SFTTrainer

from .common import run_trainer


def train(script_args, model_args, training_args) -> dict:
    return run_trainer("sft", SFTTrainer, AutoModelForCausalLM, script_args, model_args, training_args)
