"""Gradient accumulation under transformers' `Trainer`: one optimizer step over 8 examples must be the same step
whether they come as one batch of 8 or as two accumulated batches of 4, for every head.

`Trainer` passes `num_items_in_batch` (the labelled tokens of the whole accumulated batch) to a model whose forward
takes `**kwargs`, and then leaves the loss undivided by the accumulation steps: a head that ignored it reported,
and stepped on, a loss 2x too large with 2 accumulation steps (the masked LM, the seq2seq model and the classifiers
did before this test). The reference is the single batch of 8.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tolerances import gradient_tolerance, model_length, model_steps, tolerance
from transformers import Trainer, TrainingArguments

from plugformer import (
    DecomposableAttentionConfig,
    DecomposableAttentionForSequenceClassification,
    PlugformerConfig,
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
    PlugformerForMaskedLM,
    PlugformerForSequenceClassification,
    PlugformerForTokenClassification,
)


VOCAB = 40


def token_rows(label_every: int) -> list[dict]:
    """8 sequences of 8 tokens whose labelled positions differ in number between rows (so the two micro-batches hold
    different numbers of labelled tokens: a mean per micro-batch would weigh them wrongly)."""
    rows = []
    for i in range(8):
        ids = [1 + (i * 7 + j) % (VOCAB - 2) for j in range(8)]
        keep = label_every if i < 4 else 1
        rows.append({"input_ids": ids, "labels": [t if j % keep == 0 else -100 for j, t in enumerate(ids)]})
    return rows


def seq2seq_rows() -> list[dict]:
    return [
        {
            "input_ids": [1 + (i * 7 + j) % (VOCAB - 2) for j in range(8)],
            "labels": [1 + (i * 3 + j) % (VOCAB - 2) for j in range(2 + 2 * (i // 4))] + [-100] * (6 - 2 * (i // 4)),
        }
        for i in range(8)
    ]


def class_rows() -> list[dict]:
    return [{"input_ids": [1 + (i * 7 + j) % (VOCAB - 2) for j in range(8)], "labels": i % 3} for i in range(8)]


def plug(**fields) -> PlugformerConfig:
    return PlugformerConfig.from_preset("tiny", vocab_size=VOCAB, pad_token_id=0, **fields)


def decomposable() -> DecomposableAttentionConfig:
    return DecomposableAttentionConfig(
        vocab_size=VOCAB, pad_token_id=0, sep_token_id=VOCAB - 1, num_labels=3, hidden_dropout=0.0
    )


def pair_rows() -> list[dict]:
    """`class_rows` as sentence pairs: the separator after the fourth token."""
    return [{**row, "input_ids": [*row["input_ids"][:4], VOCAB - 1, *row["input_ids"][4:]]} for row in class_rows()]


HEADS = {
    "causal_lm": (lambda: PlugformerForCausalLM(plug()), lambda: token_rows(3)),
    "masked_lm": (lambda: PlugformerForMaskedLM(plug(is_causal=False)), lambda: token_rows(3)),
    "token_classification": (
        lambda: PlugformerForTokenClassification(plug(is_causal=False, num_labels=VOCAB)),
        lambda: token_rows(3),
    ),
    "seq2seq": (lambda: PlugformerForConditionalGeneration(plug(is_encoder_decoder=True)), seq2seq_rows),
    "sequence_classification": (
        lambda: PlugformerForSequenceClassification(plug(is_causal=False, num_labels=3)),
        class_rows,
    ),
    "decomposable": (lambda: DecomposableAttentionForSequenceClassification(decomposable()), lambda: pair_rows()),
}


def one_step(head: str, fused: bool, batch: int, accumulation: int, tmp_path) -> tuple[float, dict]:
    build, rows = HEADS[head]
    torch.manual_seed(0)
    model = build()
    model.fused_loss = fused
    args = TrainingArguments(
        str(tmp_path / f"{batch}x{accumulation}"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows()))
    trainer.train()
    loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    return loss, {name: p.detach().clone() for name, p in model.named_parameters()}


# every head with its own loss; the language-model heads' fused loss too (plugformer.losses)
CASES = [(head, False) for head in HEADS] + [("causal_lm", True), ("masked_lm", True)]


@pytest.mark.parametrize(("head", "fused"), CASES, ids=[f"{h}-{'fused' if f else 'unfused'}" for h, f in CASES])
def test_accumulated_step_equals_one_batch(head, fused, tmp_path):
    whole_loss, whole = one_step(head, fused, batch=8, accumulation=1, tmp_path=tmp_path)
    split_loss, split = one_step(head, fused, batch=4, accumulation=2, tmp_path=tmp_path)
    torch.manual_seed(0)
    start = HEADS[head][0]()
    # the loss: fp32 through the model, of terms max(|loss|, 1) (`model_tolerance`'s figures over 8 tokens, 9 with a
    # pair's separator)
    growth = {"length": model_length(start.config, 9), "steps": model_steps(start.config)}
    assert abs(split_loss - whole_loss) <= tolerance(torch.float32, magnitude=max(abs(whole_loss), 1.0), **growth)
    # one SGD step of 0.5: the weights differ by 0.5 times the gradients' rounding (two sums of 4 against one of 8),
    # fp32 through the model (`gradient_tolerance`), the gradients' size the step's largest move / 0.5
    moves = {name: (start.state_dict()[name] - parameter) / 0.5 for name, parameter in whole.items()}
    atol = 0.5 * gradient_tolerance(start.config, moves, tokens=9)
    for name, parameter in whole.items():
        torch.testing.assert_close(split[name], parameter, rtol=0, atol=atol, msg=name)
