"""RLHF against the learned reward model (Ouyang et al. 2022) with TRL's `RLOOTrainer`.

TRL 1.16 ships no PPO. RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024) samples several answers per prompt,
uses the mean reward of the others as each answer's baseline (no value model to train) and keeps the policy close
to the SFT reference with a KL penalty (`--beta`, TRL's default 0.05) — the RLHF objective of InstructGPT without
PPO's critic."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..arguments import PolicyArguments
from ..cards import StageCard
from ..stage_table import Stage, StageInput, register_stage


@dataclass
class RLHFArguments(PolicyArguments):
    """RLHF (RLOO): the policy stages' arguments and the folder of the model that rewards it."""

    reward_model_path: str | None = field(
        default=None,
        metadata={
            "help": "output directory of the reward stage (a num_labels=1 classifier) or of a dpo stage (its "
            "implicit reward, beta * (log pi - log pi_ref))"
        },
    )


def load_reward_model(path: str | None):
    """(reward function, its tokenizer or None): the reward stage's classifier, or a DPO stage's implicit reward
    β·(log π − log π_ref), a reward function that tokenizes for itself."""
    from transformers import AutoModelForSequenceClassification

    from ...evaluation.implicit_reward import ImplicitReward, dpo_record
    from ..common import load_tokenizer

    if not path:
        raise ValueError(
            "stage 'rlhf' needs --reward_model_path: the output directory of the reward stage (a "
            "num_labels=1 classifier) or of a dpo stage (its implicit reward)"
        )
    if dpo_record(path) is not None:
        return ImplicitReward.from_dpo_stage(path), None
    refuse_untrained_reward_head(path)
    reward_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    return reward_model.eval(), load_tokenizer(path)


def refuse_untrained_reward_head(path: str) -> None:
    """Raises `ValueError` unless `path` holds a trained reward classifier (a `...ForSequenceClassification` with one
    label): loading a language model's folder as one gave a freshly initialised reward head to train against."""
    from transformers import AutoConfig

    if not Path(path, "config.json").is_file():
        raise ValueError(
            f"--reward_model_path {path}: no config.json there; give the output directory of the reward "
            "stage or of a dpo stage"
        )
    config = AutoConfig.from_pretrained(path)
    architectures = config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures) or config.num_labels != 1:
        raise ValueError(
            f"--reward_model_path {path}: a {'/'.join(architectures) or 'model'} with "
            f"num_labels={config.num_labels}, no trained reward head (a ForSequenceClassification with "
            "num_labels=1) and no dpo record (run_info.json: reference, beta); give the reward stage's "
            "output or a dpo stage's"
        )


def reward_model_signal(reward_model, reward_tokenizer):
    """RLHF's dev signal on prompts without a verifiable answer: `(script_args, tokenizer, dev rows) ->` the reward
    model's mean score of greedy dev answers (`MeanReward`): the proxy on held-out prompts, no gold score."""

    def signal(script_args, tokenizer, rows):
        from ..selection_signals import ClassifierReward, MeanReward

        reward = reward_model if reward_tokenizer is None else ClassifierReward(reward_model, reward_tokenizer)
        return MeanReward(rows, tokenizer, [reward], max_new_tokens=script_args.max_new_tokens)

    return signal


def train(script_args, model_args, training_args) -> dict:
    """RLOO against the reward model; with `--selection_steps`, also `overoptimisation.png` in the output directory:
    the reward model's score and dev exact match against KL and steps (where the data holds a verifiable answer)."""
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM
    from trl import RLOOTrainer

    from ..common import run_trainer, sampled_tokens
    from ..selection import plot_overoptimisation

    reward_model, reward_tokenizer = load_reward_model(script_args.reward_model_path)
    info = run_trainer(
        STAGE,
        RLOOTrainer,
        AutoModelForCausalLM,
        script_args,
        model_args,
        training_args,
        evaluate=False,
        extra={"reward_model": script_args.reward_model_path},
        compute=sampled_tokens,
        reward_funcs=reward_model,
        reward_processing_classes=reward_tokenizer,
        selection_signal=reward_model_signal(reward_model, reward_tokenizer),
    )
    if "selection" in info and PartialState().is_main_process:
        path = plot_overoptimisation(
            info["selection"]["history"], Path(training_args.output_dir, "overoptimisation.png")
        )
        if path is not None:
            print(f"[rlhf] proxy reward and gold dev score: {path}")
    return info


STAGE = register_stage(
    Stage(
        name="rlhf",
        parent="sft",
        script_arguments=RLHFArguments,
        config_class="RLOOConfig",
        description="online RL against the learned reward model (TRL RLOOTrainer)",
        data_format="prompt",
        data_parallel=False,  # its per-device batch is groups of completions, which a split would change
        card=StageCard("aligned online against a learned reward model (RLOO, KL to the SFT model)", "trl.RLOOTrainer"),
        # the reward: the reward stage's classifier or a dpo stage's implicit reward (`plugformer pipeline
        # --rlhf_reward`); `plugformer compare` uses the reward stage
        inputs=(
            StageInput(flag="--reward_model_path", option="rlhf_reward", sources=("reward", "dpo"), default="reward"),
        ),
        train=train,
    )
)
