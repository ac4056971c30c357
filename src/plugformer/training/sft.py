"""Supervised fine-tuning with TRL's `SFTTrainer`: conversations through the model's chat template, loss on the
completion (the assistant's answer) only."""

from __future__ import annotations

from transformers import AutoModelForCausalLM
from trl import SFTTrainer

from .common import load_model, load_tokenizer, peft_config, stage_data, train_and_save


def train(script_args, model_args, training_args) -> dict:
    model = load_model(AutoModelForCausalLM, model_args, "sft")
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    data = stage_data("sft", script_args)
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data.get("dev"),
        processing_class=tokenizer,
        peft_config=peft_config(model_args),
    )
    return train_and_save(trainer, "sft", script_args, tokenizer)
