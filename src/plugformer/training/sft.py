"""Supervised fine-tuning with TRL's `SFTTrainer`: conversations through the model's chat template, loss on the
completion (the assistant's answer) only."""

from __future__ import annotations

from ..evaluation.cards import StageCard
from .arguments import PolicyArguments
from .stages import Stage, register_stage


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from .common import run_trainer

    return run_trainer("sft", SFTTrainer, AutoModelForCausalLM, script_args, model_args, training_args)


STAGE = register_stage(
    Stage(
        name="sft",
        parent="pretrain",
        script_arguments=PolicyArguments,
        config_class="SFTConfig",
        description="supervised fine-tuning on conversations (TRL SFTTrainer)",
        data_format="conversation",
        data_parallel=True,
        card=StageCard("fine-tuned on conversations, loss on the answers", "trl.SFTTrainer"),
        language_model_loss=True,
        train=train,
    )
)
