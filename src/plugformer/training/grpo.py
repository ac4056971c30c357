"""RLVR with TRL's `GRPOTrainer` (Shao et al. 2024): groups of sampled answers per prompt, scored by verifiable
rewards (exact numeric answer, answer format), generated with plain `generate`.

The shipped configs set TRL 1.16's default loss explicitly, `loss_type: dapo` (Yu et al. 2025: token-level losses
normalised by the active tokens of the whole accumulated batch, no length bias), with `beta: 0.0` (no KL term, no
reference model); the model card names both."""

from __future__ import annotations

from ..evaluation.cards import StageCard
from ..evaluation.rewards import REWARD_FUNCTIONS
from .arguments import GRPOArguments
from .stages import Stage, register_stage


def reward_functions(names: list[str]) -> list:
    unknown = [name for name in names if name not in REWARD_FUNCTIONS]
    if unknown or not names:
        raise ValueError(f"reward_functions={names}: choose one or more of {sorted(REWARD_FUNCTIONS)}")
    return [REWARD_FUNCTIONS[name] for name in names]


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from .common import run_trainer, sampled_tokens

    rewards = reward_functions(script_args.reward_functions)
    return run_trainer(
        "grpo", GRPOTrainer, AutoModelForCausalLM, script_args, model_args, training_args,
        evaluate=False, compute=sampled_tokens, reward_funcs=rewards,
    )  # fmt: skip


STAGE = register_stage(
    Stage(
        name="grpo",
        parent="sft",
        script_arguments=GRPOArguments,
        config_class="GRPOConfig",
        description="RL with verifiable rewards (TRL GRPOTrainer)",
        data_format="prompt",
        data_parallel=False,  # its per-device batch is groups of completions, which a split would change
        card=StageCard("trained with verifiable rewards (GRPO)", "trl.GRPOTrainer"),
        train=train,
    )
)
