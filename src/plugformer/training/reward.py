"""Reward modelling with TRL's `RewardTrainer`: a `num_labels=1` sequence-classification head on the SFT model,
trained on preference pairs (Bradley-Terry: the chosen answer should score higher than the rejected one)."""

from __future__ import annotations

from transformers import AutoModelForSequenceClassification
from trl import RewardTrainer

from .common import run_trainer


def train(script_args, model_args, training_args) -> dict:
    # the language-model head is dropped; the scalar `score` head is new
    return run_trainer(
        "reward", RewardTrainer, AutoModelForSequenceClassification, script_args, model_args, training_args,
        model_kwargs={"num_labels": 1},
    )  # fmt: skip
