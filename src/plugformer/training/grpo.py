"""RLVR with TRL's `GRPOTrainer` (Shao et al. 2024): groups of sampled answers per prompt, scored by verifiable
rewards (exact numeric answer, answer format), generated with plain `generate`."""

from __future__ import annotations

from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from .common import load_model, load_tokenizer, peft_config, stage_data, train_and_save
from .rewards import REWARD_FUNCTIONS


def reward_functions(names: list[str]) -> list:
    unknown = [name for name in names if name not in REWARD_FUNCTIONS]
    if unknown or not names:
        raise ValueError(f"reward_functions={names}: choose one or more of {sorted(REWARD_FUNCTIONS)}")
    return [REWARD_FUNCTIONS[name] for name in names]


def train(script_args, model_args, training_args) -> dict:
    rewards = reward_functions(script_args.reward_functions)
    model = load_model(AutoModelForCausalLM, model_args, "grpo")
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    data = stage_data("grpo", script_args)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=data["train"],
        processing_class=tokenizer,
        peft_config=peft_config(model_args),
    )
    return train_and_save(trainer, "grpo", script_args, tokenizer)
