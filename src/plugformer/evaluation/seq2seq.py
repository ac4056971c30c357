"""Scores of an encoder-decoder on `source` -> `target` rows (the `seq2seq` stage's data): exact match of the
generated target (with a 95% Wilson interval), corpus chrF (`load_metric("chrf")`, sacreBLEU's definition) and the
perplexity of the reference target given the source.

A source is encoded as the stage trains on it (`encode_sources`): its tokens then end of text; a target is its tokens
then end of text, which generation stops at.
"""

from __future__ import annotations

import math

import torch

from .metrics import load_metric


def encode_sources(tokenizer, sources: list[str], max_length: int) -> list[list[int]]:
    """Each source's token ids, cut to `max_length` - 1, then the end-of-text id (a number, as a csv column of
    numbers loads, is read as its text)."""
    ids = tokenizer(
        [str(source) for source in sources], add_special_tokens=False, truncation=True, max_length=max_length - 1
    )["input_ids"]
    return [[*row, tokenizer.eos_token_id] for row in ids]


def encode_targets(tokenizer, targets: list[str], max_length: int) -> list[list[int]]:
    """Each target's token ids, cut to `max_length` - 1, then the end-of-text id (where generation stops)."""
    return encode_sources(tokenizer, targets, max_length)


def padded(tokenizer, rows: list[list[int]], device) -> dict[str, torch.Tensor]:
    """`rows` right-padded into `input_ids` and `attention_mask` (B, T)."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


@torch.no_grad()
def generate_targets(
    model,
    tokenizer,
    sources: list[str],
    max_new_tokens: int = 32,
    batch_size: int = 64,
    num_beams: int = 1,
    max_source_length: int = 128,
) -> list[str]:
    """The model's target for each source: greedy (`num_beams=1`) or beam search, up to end of text."""
    was_training = model.training
    model.eval()
    encoded = encode_sources(tokenizer, sources, max_source_length)
    outputs = []
    try:
        for start in range(0, len(encoded), batch_size):
            batch = padded(tokenizer, encoded[start : start + batch_size], model.device)
            generated = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=num_beams,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            outputs += tokenizer.batch_decode(generated, skip_special_tokens=True)  # (B, 1 + new): start token first
    finally:
        model.train(was_training)
    return [text.strip() for text in outputs]


@torch.no_grad()
def target_losses(
    model, tokenizer, rows, batch_size: int = 64, max_source_length: int = 128, max_target_length: int = 128
) -> tuple[list[float], list[int]]:
    """Each row's summed loss (nats) of its reference target (end of text included) given its source, and the
    number of target tokens: teacher forcing, as training scores it."""
    was_training = model.training
    model.eval()
    sources = encode_sources(tokenizer, list(rows["source"]), max_source_length)
    targets = encode_targets(tokenizer, list(rows["target"]), max_target_length)
    losses, counts = [], []
    try:
        for start in range(0, len(sources), batch_size):
            batch = padded(tokenizer, sources[start : start + batch_size], model.device)
            labels = padded(tokenizer, targets[start : start + batch_size], model.device)
            labels = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)  # (B, T)
            logits = model(**batch, labels=labels).logits.float()  # (B, T, V): labels shifted right inside
            loss = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
            )  # (B, T), 0 at pads
            losses += loss.sum(dim=1).tolist()
            counts += (labels != -100).sum(dim=1).tolist()
    finally:
        model.train(was_training)
    return losses, counts


def seq2seq_scores(
    model,
    tokenizer,
    rows,
    max_new_tokens: int = 32,
    batch_size: int = 64,
    num_beams: int = 1,
    max_source_length: int = 128,
    max_target_length: int = 128,
) -> dict:
    """Every score of an encoder-decoder on `rows` (`source`, `target`).

    Returns:
        `dict`: `exact_match` (generated target equal to the reference, surrounding spaces aside) with
        `exact_match_ci95`, `chrf` (corpus chrF, 0-100), `perplexity` of the reference targets, `examples`; per
        example (for paired tests) `correct` (1/0), `chrf_per_example`, `target_losses` and `target_tokens`; and
        `samples`, the first three sources with their generated and reference targets.
    """
    from .stats import wilson_interval

    references = [str(target).strip() for target in rows["target"]]
    generated = generate_targets(
        model, tokenizer, list(rows["source"]), max_new_tokens, batch_size, num_beams, max_source_length
    )
    correct = [int(g == r) for g, r in zip(generated, references, strict=True)]
    chrf = load_metric("chrf").compute(predictions=generated, references=references)
    losses, counts = target_losses(model, tokenizer, rows, batch_size, max_source_length, max_target_length)
    return {
        "exact_match": sum(correct) / max(len(correct), 1),
        "exact_match_ci95": wilson_interval(sum(correct), len(correct)),
        "chrf": chrf["chrf"],
        "perplexity": math.exp(min(sum(losses) / max(sum(counts), 1), 50.0)),
        "examples": len(correct),
        "num_beams": num_beams,
        "correct": correct,
        "chrf_per_example": chrf["chrf_per_example"],
        "target_losses": losses,
        "target_tokens": counts,
        "samples": [
            {"source": str(s), "generated": g, "target": r}
            for s, g, r in list(zip(rows["source"], generated, references, strict=True))[:3]
        ],
    }


def directory_scores(args, tokenizer, rows) -> dict:
    """`plugformer eval` of a saved encoder-decoder (`args.model`) on `rows` (`source`, `target`): `seq2seq_scores`
    with the beam width it was trained to search (its `generation_config`), targets up to `--max_new_tokens` or
    the longest it was trained on, and sources up to its position table."""
    from transformers import AutoModelForSeq2SeqLM

    from ..runtime.loading import load_checked

    missing = [column for column in ("source", "target") if column not in rows.column_names]
    if missing:
        raise ValueError(
            f"an encoder-decoder is scored on source -> target pairs; the held-out split lacks "
            f"{missing} (it has {sorted(rows.column_names)})"
        )
    model = load_checked(AutoModelForSeq2SeqLM, args.model)
    return seq2seq_scores(
        model, tokenizer, rows, batch_size=args.batch_size, **saved_budget(model, args.max_new_tokens)
    )


def saved_budget(model, max_new_tokens: int) -> dict:
    """How a saved encoder-decoder is scored (eval and compare alike): the beam width it was trained to search (its
    `generation_config`), targets up to `max_new_tokens` or the longest it was trained on, whichever is more, and
    sources and reference targets up to its position table."""
    generation = model.generation_config
    longest = model.config.max_position_embeddings
    return {
        "max_new_tokens": max(max_new_tokens, generation.max_new_tokens or 0),
        "num_beams": generation.num_beams or 1,
        "max_source_length": longest,
        "max_target_length": longest,
    }
