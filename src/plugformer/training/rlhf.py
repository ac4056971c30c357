"""RLHF against the learned reward model (Ouyang et al. 2022) with TRL's `RLOOTrainer`.

TRL 1.16 ships no PPO. RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024) samples several answers per prompt,
uses the mean reward of the others as each answer's baseline (no value model to train) and keeps the policy close
to the SFT reference with a KL penalty (`--beta`, TRL's default 0.05) — the RLHF objective of InstructGPT without
PPO's critic."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from trl import RLOOTrainer

from .common import load_tokenizer, run_trainer


def load_reward_model(path: str | None):
    if not path:
        raise ValueError("stage 'rlhf' needs --reward_model_path: the output directory of the reward stage")
    reward_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    return reward_model.eval(), load_tokenizer(path)


def train(script_args, model_args, training_args) -> dict:
    reward_model, reward_tokenizer = load_reward_model(script_args.reward_model_path)
    return run_trainer(
        "rlhf", RLOOTrainer, AutoModelForCausalLM, script_args, model_args, training_args,
        evaluate=False, extra={"reward_model": script_args.reward_model_path},
        reward_funcs=reward_model, reward_processing_classes=reward_tokenizer,
    )  # fmt: skip
