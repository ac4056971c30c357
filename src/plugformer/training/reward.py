"""Reward modelling with TRL's `RewardTrainer`: a `num_labels=1` sequence-classification head on the SFT model,
trained on preference pairs (Bradley-Terry: the chosen answer should score higher than the rejected one)."""

from __future__ import annotations

from transformers import AutoModelForSequenceClassification
from trl import RewardTrainer

from .common import load_model, load_tokenizer, peft_config, stage_data, train_and_save


def train(script_args, model_args, training_args) -> dict:
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    # the language-model head is dropped; the scalar `score` head is new
    model = load_model(AutoModelForSequenceClassification, model_args, "reward", num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    data = stage_data("reward", script_args)
    trainer = RewardTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data.get("dev"),
        processing_class=tokenizer,
        peft_config=peft_config(model_args),
    )
    return train_and_save(trainer, "reward", script_args, tokenizer)
