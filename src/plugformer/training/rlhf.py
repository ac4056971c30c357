"""RLHF against the learned reward model (Ouyang et al. 2022) with TRL's `RLOOTrainer`.

TRL 1.16 ships no PPO. RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024) samples several answers per prompt,
uses the mean reward of the others as each answer's baseline (no value model to train) and keeps the policy close
to the SFT reference with a KL penalty (`--beta`, TRL's default 0.05) — the RLHF objective of InstructGPT without
PPO's critic."""

from __future__ import annotations

from pathlib import Path

from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from trl import RLOOTrainer

from ..evaluation.implicit_reward import ImplicitReward, dpo_record
from .common import load_tokenizer, run_trainer
from .selection import plot_overoptimisation


def load_reward_model(path: str | None):
    """(reward function, its tokenizer or None): the reward stage's classifier, or a DPO stage's implicit reward
    β·(log π − log π_ref), a reward function that tokenizes for itself."""
    if not path:
        raise ValueError("stage 'rlhf' needs --reward_model_path: the output directory of the reward stage (a "
                         "num_labels=1 classifier) or of a dpo stage (its implicit reward)")  # fmt: skip
    if dpo_record(path) is not None:
        return ImplicitReward.from_dpo_stage(path), None
    reward_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    return reward_model.eval(), load_tokenizer(path)


def train(script_args, model_args, training_args) -> dict:
    """RLOO against the reward model; with `--selection_steps`, also `overoptimisation.png` in the output directory:
    the reward model's score and dev exact match against KL and steps."""
    reward_model, reward_tokenizer = load_reward_model(script_args.reward_model_path)
    info = run_trainer(
        "rlhf", RLOOTrainer, AutoModelForCausalLM, script_args, model_args, training_args,
        evaluate=False, extra={"reward_model": script_args.reward_model_path},
        reward_funcs=reward_model, reward_processing_classes=reward_tokenizer,
    )  # fmt: skip
    if "selection" in info and PartialState().is_main_process:
        path = plot_overoptimisation(
            info["selection"]["history"], Path(training_args.output_dir, "overoptimisation.png")
        )
        if path is not None:
            print(f"[rlhf] proxy reward and gold dev score: {path}")
    return info
