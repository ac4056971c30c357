"""What a language model is scored by: greedy exact match of its answers, pass@k of sampled ones, the pairwise
accuracy of a reward model or a reward function, and perplexity."""

from __future__ import annotations

import math

import torch

from .answers import generate_answers, prompt_text
from .metrics import load_metric
from .rewards import exact_match_reward, format_reward


def exact_match(
    model, tokenizer, rows, max_new_tokens: int = 32, batch_size: int = 64, synced_gpus: bool = False
) -> dict:
    """Exact-match accuracy and answer-format rate of greedy answers on `rows` (`prompt` and `answer` columns).

    Returns:
        `dict`: `exact_match` and `format` (fractions), `examples` (their count), `correct` (1/0 per example, in
        order: the paired tests compare stages on it) and `samples` (the first three prompts with their
        completions).
    """
    prompts, answers = list(rows["prompt"]), list(rows["answer"])
    completions = generate_answers(model, tokenizer, prompts, max_new_tokens, batch_size, synced_gpus=synced_gpus)
    scores = load_metric("numeric_exact_match").compute(predictions=completions, references=[str(a) for a in answers])
    formatted = format_reward(completions)
    return {
        "exact_match": scores["exact_match"],
        "format": sum(formatted) / max(len(formatted), 1),
        "examples": len(completions),
        "correct": [int(c) for c in exact_match_reward(completions, answer=[str(a) for a in answers])],
        "samples": [
            {"prompt": prompt_text(tokenizer, p), "completion": c, "answer": a}
            for p, c, a in list(zip(prompts, completions, answers, strict=True))[:3]
        ],
    }


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate from `samples` draws of which `correct` were right (Chen et al. 2021, eq. 1):
    1 − C(n−c, k) / C(n, k), the chance that k of the n draws, taken without replacement, hold a right one.

    >>> pass_at_k(8, 0, 8), pass_at_k(8, 1, 8), pass_at_k(8, 2, 1)
    (0.0, 1.0, 0.25)
    """
    if not 0 <= correct <= samples or not 1 <= k <= samples:
        raise ValueError(f"pass_at_k: need 0 <= correct ({correct}) <= samples ({samples}) and 1 <= k ({k}) <= samples")
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def sampled_pass_at_k(
    model,
    tokenizer,
    rows,
    samples: int = 8,
    ks: tuple[int, ...] = (1, 8),
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    batch_size: int = 64,
) -> dict:
    """pass@k on `rows` (`prompt` and `answer` columns) from `samples` completions per prompt at `temperature`,
    averaged over prompts; the headroom RL has over greedy decoding.

    Returns:
        `dict`: `pass@k` for each k, `samples` and `temperature`, and `examples` (the number of prompts).
    """
    prompts, answers = list(rows["prompt"]), [str(a) for a in rows["answer"]]
    completions = generate_answers(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        max(1, batch_size // samples),
        samples=samples,
        temperature=temperature,
    )
    right = exact_match_reward(completions, answer=[a for a in answers for _ in range(samples)])
    per_prompt = [int(sum(right[i * samples : (i + 1) * samples])) for i in range(len(prompts))]
    results = {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in per_prompt) / max(len(prompts), 1) for k in ks}
    return {**results, "samples": samples, "temperature": temperature, "examples": len(prompts)}


def preference_accuracy(model, tokenizer, rows, batch_size: int = 64) -> float:
    """Fraction of preference pairs (`prompt`, `chosen`, `rejected`) where a reward model scores `chosen` higher."""
    model.eval()

    @torch.no_grad()
    def reward(prompts: list, answers: list) -> list[float]:
        texts = [
            tokenizer.apply_chat_template(prompt + answer, tokenize=False)
            if isinstance(prompt, list)
            else prompt + answer
            for prompt, answer in zip(prompts, answers, strict=True)
        ]
        values = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
            values.append(model(**batch.to(model.device)).logits[:, 0].float().cpu())  # (B, 1) -> (B,)
        return torch.cat(values).tolist()

    return reward_function_accuracy(reward, rows)


def reward_function_accuracy(reward, rows) -> float:
    """Fraction of preference pairs (`prompt`, `chosen`, `rejected`) that a reward function
    (`f(prompts, completions) -> list[float]`, such as `ImplicitReward`) scores `chosen` above `rejected`."""
    prompts = list(rows["prompt"])
    chosen, rejected = reward(prompts, list(rows["chosen"])), reward(prompts, list(rows["rejected"]))
    metric = load_metric("pairwise_accuracy")
    return metric.compute(predictions=chosen, references=rejected)["pairwise_accuracy"]


@torch.no_grad()
def document_losses(model, tokenizer, texts: list[str], batch_size: int = 32) -> tuple[list[float], list[int]]:
    """Each `<bos> text <eos>` document's summed next-token loss (nats) and its number of predicted tokens."""
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    losses, counts = [], []
    try:
        for start in range(0, len(texts), batch_size):
            documents = [tokenizer.bos_token + t + tokenizer.eos_token for t in texts[start : start + batch_size]]
            batch = tokenizer(documents, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            logits = model(**batch).logits[:, :-1].float()  # (B, T-1, V): predictions of tokens 1..T-1
            targets = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), targets, ignore_index=-100, reduction="none"
            )  # (B, T-1), 0 at pads
            losses += loss.sum(dim=1).tolist()
            counts += (targets != -100).sum(dim=1).tolist()
    finally:
        tokenizer.padding_side = side
    return losses, counts


def perplexity(model, tokenizer, texts: list[str], batch_size: int = 32) -> float:
    """exp of the mean next-token loss over every token of `<bos> text <eos>` documents (pads excluded)."""
    losses, counts = document_losses(model, tokenizer, texts, batch_size)
    return math.exp(sum(losses) / max(sum(counts), 1))
