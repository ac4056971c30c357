"""Held-out scores of a masked LM (a BERT-style encoder, `is_causal=False`): each document read as pretraining reads
it (`<bos> text <eos>`), a seeded `rate` of its tokens replaced by the mask token, and the model scored on
predicting them: the masked tokens' perplexity and accuracy. Every masked token is the mask token (no 80/10/10
split, which only regularises training), and the draw depends on `seed` alone, so two models are scored on the same
masked positions and their per-document losses pair up."""

from __future__ import annotations

import math

import torch

from ..data.packing import encode_documents
from ..runtime.loading import load_checked
from .held_out import rows_digest


def masked_documents(tokenizer, texts: list[str], rate: float, seed: int, max_length: int) -> list[tuple]:
    """(input ids with the drawn tokens masked, labels: the drawn tokens' ids, -100 elsewhere) per document, cut to
    `max_length` tokens; `max(1, round(rate * n))` of each document's n text tokens are drawn (never `<bos>` or
    `<eos>`)."""
    generator = torch.Generator().manual_seed(seed)
    documents = []
    for ids in encode_documents(texts, tokenizer):
        ids = torch.tensor(ids[:max_length])
        candidates = torch.arange(1, len(ids) - (ids[-1] == tokenizer.eos_token_id).long())  # text tokens only
        if len(candidates) == 0:
            raise ValueError("a held-out document has no text token to mask (an empty text)")
        count = max(1, round(rate * len(candidates)))
        drawn = candidates[torch.randperm(len(candidates), generator=generator)[:count]]
        labels = torch.full_like(ids, -100)
        labels[drawn] = ids[drawn]
        masked = ids.clone()
        masked[drawn] = tokenizer.mask_token_id
        documents.append((masked, labels))
    return documents


@torch.no_grad()
def masked_token_scores(model, tokenizer, texts: list[str], seed: int = 0, rate: float = 0.15, batch_size: int = 32):
    """`masked_token_perplexity` (exp of the mean loss over every masked token), `masked_token_accuracy`,
    `masked_tokens`, and per document its summed loss (`masked_losses`, nats) and masked-token count."""
    if tokenizer.mask_token_id is None:
        raise ValueError("a masked LM is scored on masked tokens; this tokenizer has no mask token")
    documents = masked_documents(tokenizer, texts, rate, seed, model.config.max_position_embeddings)
    model.eval()
    losses, counts, correct = [], [], 0
    for start in range(0, len(documents), batch_size):
        batch = documents[start : start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)  # (B, T), right-padded
        labels = torch.full((len(batch), width), -100)
        for row, (masked, targets) in enumerate(batch):
            ids[row, : len(masked)], labels[row, : len(targets)] = masked, targets
        mask = (torch.arange(width)[None] < torch.tensor([len(m) for m, _ in batch])[:, None]).long()
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits.float().cpu()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        losses += loss.sum(dim=1).tolist()  # (B, T) -> (B,): 0 at unmasked positions
        counts += (labels != -100).sum(dim=1).tolist()
        correct += int(((logits.argmax(-1) == labels) & (labels != -100)).sum())
    total = max(sum(counts), 1)
    return {
        "masked_token_perplexity": math.exp(sum(losses) / total),
        "masked_token_accuracy": correct / total,
        "masked_tokens": sum(counts),
        "masked_losses": losses,
        "masked_counts": counts,
        "mask_rate": rate,
        "mask_seed": seed,
    }


def masked_lm_scores(args, tokenizer, rows) -> dict:
    """A masked LM's scores on the `text` of `rows` (`masked.masked_token_scores`, masks drawn from
    `--dataset_seed`)."""
    from transformers import AutoModelForMaskedLM

    if "text" not in rows.column_names:
        raise ValueError(f"a masked LM is scored on held-out text; the split has the columns {rows.column_names}")
    model = load_checked(AutoModelForMaskedLM, args.model)
    scores = masked_token_scores(model, tokenizer, list(rows["text"]), args.dataset_seed, batch_size=args.batch_size)
    return {"examples": len(rows), "data_sha256": rows_digest(rows), **scores}
