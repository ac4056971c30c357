"""Greedy or sampled answers of a causal LM to prompts: what exact match, pass@k, rejection sampling and the scoring
of a pretrained model in its corpus's format generate."""

from __future__ import annotations

import torch

from ..data.tokenization import generation_eos_token_ids


def prompt_text(tokenizer, prompt: str | list[dict]) -> str:
    """A conversational prompt through the chat template (ending with the assistant's turn), or the text itself."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def generate_answers(
    model,
    tokenizer,
    prompts: list,
    max_new_tokens: int = 32,
    batch_size: int = 64,
    samples: int = 0,
    temperature: float = 1.0,
    synced_gpus: bool = False,
    counts: dict | None = None,
) -> list[str]:
    """Completions of `prompts` (left-padded batches; stops at end of text or end of turn).

    Greedy with `samples=0`; else `samples` completions per prompt drawn at `temperature` (pure sampling: no top-k or
    top-p), returned prompt by prompt. `synced_gpus` keeps every rank generating until all are done (a sharded model
    needs each rank in every forward). A `counts` dict gets the tokens processed added to its `prompt_tokens` (each
    returned sequence's prompt, padding excluded) and `completion_tokens` (generated up to the end token, included).
    """
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    was_training = model.training
    model.eval()
    completions = []
    sampling = {
        "do_sample": True,
        "temperature": temperature,
        "top_k": 0,
        "top_p": 1.0,
        "num_return_sequences": samples,
    }
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [prompt_text(tokenizer, p) for p in prompts[start : start + batch_size]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                **(sampling if samples else {"do_sample": False}),
                eos_token_id=generation_eos_token_ids(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=synced_gpus,
            )
            new = output[:, batch["input_ids"].shape[1] :]  # (B * max(samples, 1), prompt + new) -> (.., new)
            completions += tokenizer.batch_decode(new, skip_special_tokens=True)
            if counts is not None:
                counts["prompt_tokens"] = counts.get("prompt_tokens", 0) + int(batch["attention_mask"].sum()) * max(
                    samples, 1
                )
                counts["completion_tokens"] = counts.get("completion_tokens", 0) + generated_lengths(new, tokenizer)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return completions


def generated_lengths(new_tokens: torch.Tensor, tokenizer) -> int:
    """The tokens `generate` produced in `new_tokens` (B, new): up to each row's first end token, included (what
    follows it is padding)."""
    ends = torch.isin(new_tokens, torch.tensor(generation_eos_token_ids(tokenizer), device=new_tokens.device))
    # (B, new): 1 up to and including the first end token, 0 after it
    before_end = (ends.long().cumsum(dim=1) - ends.long()) == 0
    return int(before_end.sum())
