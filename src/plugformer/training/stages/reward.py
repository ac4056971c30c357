"""Reward modelling with TRL's `RewardTrainer`: a `num_labels=1` sequence-classification head on the SFT model,
trained on preference pairs (Bradley-Terry: the chosen answer should score higher than the rejected one)."""

from __future__ import annotations

from ..arguments import SelectionArguments
from ..cards import StageCard
from ..stage_table import Stage, register_stage


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForSequenceClassification
    from trl import RewardTrainer

    from ..common import run_trainer

    # the language-model head is dropped; the scalar `score` head is new
    return run_trainer(
        STAGE,
        RewardTrainer,
        AutoModelForSequenceClassification,
        script_args,
        model_args,
        training_args,
        model_kwargs={"num_labels": 1},
        selection_signal=pairwise_accuracy_signal,
    )


def pairwise_accuracy_signal(script_args, tokenizer, rows):
    """The reward stage's dev signal, whatever its data: `RewardAccuracy` on the dev pairs."""
    from ..selection_signals import RewardAccuracy

    return RewardAccuracy(rows, tokenizer)


STAGE = register_stage(
    Stage(
        name="reward",
        parent="sft",
        script_arguments=SelectionArguments,
        config_class="RewardConfig",
        description="reward model on preference pairs (TRL RewardTrainer)",
        data_format="preference",
        data_parallel=True,
        card=StageCard(
            "a reward model scoring answers, trained on preference pairs", "trl.RewardTrainer", "text-classification"
        ),
        train=train,
    )
)
