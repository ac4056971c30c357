"""A pretrained model asked as its corpus writes a problem: before post-training, a model trained on the task's text
alone has never seen the chat template, so exact match through it measures the format, not the skill (the embedded
arithmetic's pretrained model answers about 2% through the template and over 90% when asked as its corpus asks)."""

from __future__ import annotations

import json
from pathlib import Path

from .answers import generate_answers
from .rewards import exact_match_reward, format_reward


def trained_on_text(model: str) -> bool:
    """Whether a stage directory's run trained on plain text (`run_info.json`'s `data_format`: pretraining)."""
    info = Path(model, "run_info.json")
    return info.is_file() and json.loads(info.read_text()).get("data_format") == "text"


def pretraining_format_scores(model, tokenizer, rows, max_new_tokens: int = 32, batch_size: int = 64) -> dict:
    """`pretraining_format_exact_match` keyed for `plugformer eval`'s results, beside the chat-template scores.

    Returns:
        `dict`: `pretraining_format` (`prompt`, `exact_match`, `format`, `exact_match_ci95`), and per example
        `pretraining_format_correct` (1/0, in order) and `pretraining_format_samples` (the first three).
    """
    scores = pretraining_format_exact_match(model, tokenizer, rows, max_new_tokens, batch_size)
    return {
        "pretraining_format": {k: scores[k] for k in ("prompt", "exact_match", "format", "exact_match_ci95")},
        "pretraining_format_correct": scores["correct"],
        "pretraining_format_samples": scores["samples"],
    }


def pretraining_format_exact_match(model, tokenizer, rows, max_new_tokens: int = 32, batch_size: int = 64) -> dict:
    """Greedy exact match of a model trained on the task's text alone, asked as its corpus writes a problem
    (`data.sources.pretraining_prompt`) instead of through the chat template it never saw: what it knows before any
    post-training. Each answer is read up to the end of its first `####` line (the model may go on to a new
    document).

    Returns:
        `dict`: as `language_scores.exact_match` (`exact_match`, `format`, `examples`, `correct`, `samples`) with
        `exact_match_ci95` (Wilson) and `prompt`, the question's wording with `{question}` in place of the question.
    """
    from ..data.sources import ANSWER_MARKER, pretraining_prompt
    from .stats import wilson_interval

    questions = [prompt[-1]["content"] for prompt in rows["prompt"]]
    answers = [str(answer) for answer in rows["answer"]]
    # a document of the corpus starts with `<bos>` (`data.packing`), and so does the question
    prompts = [(tokenizer.bos_token or "") + pretraining_prompt(question) for question in questions]
    completions = generate_answers(model, tokenizer, prompts, max_new_tokens, batch_size)
    completions = [through_first_answer(c, ANSWER_MARKER) for c in completions]
    correct = [int(c) for c in exact_match_reward(completions, answer=answers)]
    formatted = format_reward(completions)
    return {
        "prompt": pretraining_prompt("{question}"),
        "exact_match": sum(correct) / max(len(correct), 1),
        "format": sum(formatted) / max(len(formatted), 1),
        "examples": len(correct),
        "correct": correct,
        "exact_match_ci95": wilson_interval(sum(correct), len(correct)),
        "samples": [
            {"prompt": p, "completion": c, "answer": a}
            for p, c, a in list(zip(prompts, completions, answers, strict=True))[:3]
        ],
    }


def through_first_answer(text: str, marker: str) -> str:
    """`text` up to the end of the line of its first `marker`; all of it when there is none.

    >>> through_first_answer(" 2+3=5\\n#### 5\\nQuestion: What is 1 + 1?", "####")
    ' 2+3=5\\n#### 5'
    """
    head, found, tail = text.partition(marker)
    return head + found + tail.split("\n", 1)[0] if found else text
