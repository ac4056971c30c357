"""Held-out exact match: greedy answers to the prompts of a split, scored by the verifiable rewards."""

from __future__ import annotations

import torch

from ..tokenization import generation_eos_token_ids
from .rewards import exact_match_reward, format_reward


def prompt_text(tokenizer, prompt: str | list[dict]) -> str:
    """A conversational prompt through the chat template (ending with the assistant's turn), or the text itself."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list, max_new_tokens: int = 32, batch_size: int = 64) -> list[str]:
    """Greedy completions of `prompts` (left-padded batches; stops at end of text or end of turn)."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    was_training = model.training
    model.eval()
    completions = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [prompt_text(tokenizer, p) for p in prompts[start : start + batch_size]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=generation_eos_token_ids(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
            )
            # (B, prompt + new) -> (B, new)
            completions += tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return completions


def exact_match(model, tokenizer, rows, max_new_tokens: int = 32, batch_size: int = 64) -> dict:
    """Exact-match accuracy and answer-format rate of greedy answers on `rows` (`prompt` and `answer` columns).

    Returns:
        `dict`: `exact_match` and `format` (fractions), `examples` (their count) and `samples` (the first three
        prompts with their completions).
    """
    prompts, answers = list(rows["prompt"]), list(rows["answer"])
    completions = generate_answers(model, tokenizer, prompts, max_new_tokens, batch_size)
    correct = exact_match_reward(completions, answer=answers)
    formatted = format_reward(completions)
    return {
        "exact_match": sum(correct) / max(len(correct), 1),
        "format": sum(formatted) / max(len(formatted), 1),
        "examples": len(correct),
        "samples": [
            {"prompt": prompt_text(tokenizer, p), "completion": c, "answer": a}
            for p, c, a in list(zip(prompts, completions, answers, strict=True))[:3]
        ],
    }


@torch.no_grad()
def preference_accuracy(model, tokenizer, rows, batch_size: int = 64) -> float:
    """Fraction of preference pairs (`prompt`, `chosen`, `rejected`) where a reward model scores `chosen` higher."""
    model.eval()

    def scores(column: str) -> torch.Tensor:
        texts = [
            tokenizer.apply_chat_template(prompt + answer, tokenize=False)
            if isinstance(prompt, list)
            else prompt + answer
            for prompt, answer in zip(rows["prompt"], rows[column], strict=True)
        ]
        values = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
            values.append(model(**batch.to(model.device)).logits[:, 0].float().cpu())  # (B, 1) -> (B,)
        return torch.cat(values)

    return (scores("chosen") > scores("rejected")).float().mean().item()
