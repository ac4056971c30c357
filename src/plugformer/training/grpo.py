"""RLVR with TRL's `GRPOTrainer` (Shao et al. 2024): groups of sampled answers per prompt, scored by verifiable
rewards (exact numeric answer, answer format), generated with plain `generate`."""

from __future__ import annotations

from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from ..evaluation.rewards import REWARD_FUNCTIONS
from .common import run_trainer


def reward_functions(names: list[str]) -> list:
    unknown = [name for name in names if name not in REWARD_FUNCTIONS]
    if unknown or not names:
        raise ValueError(f"reward_functions={names}: choose one or more of {sorted(REWARD_FUNCTIONS)}")
    return [REWARD_FUNCTIONS[name] for name in names]


def train(script_args, model_args, training_args) -> dict:
    rewards = reward_functions(script_args.reward_functions)
    return run_trainer(
        "grpo", GRPOTrainer, AutoModelForCausalLM, script_args, model_args, training_args,
        evaluate=False, reward_funcs=rewards,
    )  # fmt: skip
