"""Direct preference optimisation with TRL's `DPOTrainer` (Rafailov et al. 2023) on preference pairs; the
reference model is the starting (SFT) model, rebuilt by TRL from its directory or, with LoRA, the adapter-free
base."""

from __future__ import annotations

from transformers import AutoModelForCausalLM
from trl import DPOTrainer

from .common import load_model, load_tokenizer, peft_config, stage_data, train_and_save


def train(script_args, model_args, training_args) -> dict:
    model = load_model(AutoModelForCausalLM, model_args, "dpo")
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    data = stage_data("dpo", script_args)
    trainer = DPOTrainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data.get("dev"),
        processing_class=tokenizer,
        peft_config=peft_config(model_args),
    )
    return train_and_save(trainer, "dpo", script_args, tokenizer)
