"""A pretrained model is also scored as its corpus asks a question (`evaluation.pretrained`): it never saw the chat
template, so exact match through the template measures the format, not what the model knows."""

from __future__ import annotations

import random

from plugformer.data.sources import Problem, embedded_dataset, pretraining_texts, unworked_texts
from plugformer.evaluation import pretrained


def test_the_corpus_writes_a_worked_problem_after_the_prompt_a_pretrained_model_is_asked():
    problem = Problem("add", 347, 85, "What is 347 + 85?")
    documents = {pretraining_texts(problem, random.Random(seed)) for seed in range(20)}
    # both kinds of document occur; the question-answer one is the prompt, a space, the worked solution
    assert documents == {
        "347 + 85: 7+5=12, 4+8+1=13, 3+0+1=4, so 347 + 85 = 432.",
        "Question: What is 347 + 85?\nAnswer: 347 + 85: 7+5=12, 4+8+1=13, 3+0+1=4\n#### 432",
    }


def test_a_corpus_without_the_working_tells_a_problem_bare_or_its_facts_out_of_order():
    problem = Problem("add", 347, 85, "What is 347 + 85?")
    documents = {unworked_texts(problem, random.Random(seed)) for seed in range(40)}
    bare = "Question: What is 347 + 85?\nAnswer: #### 432"
    facts = {"7+5=12", "4+8+1=13", "3+0+1=4"}
    assert bare in documents
    # the facts of the column method, never in its order, and never beside the problem's operands
    assert all(set(d.rstrip(".").split(", ")) == facts for d in documents - {bare})
    assert {d.rstrip(".").split(", ")[0] for d in documents - {bare}} > {"7+5=12"}


def test_direct_answer_fraction_sets_the_share_of_the_pretraining_corpus_told_without_the_working():
    def worked(texts):  # a worked document shows two facts in the method's order, lowest digit first
        return sum(" so " in t or "\n####" in t for t in texts)

    sizes = {"train": 400}
    assert worked(embedded_dataset("text", sizes, direct_fraction=0.0)["train"]["text"]) == 400
    assert worked(embedded_dataset("text", sizes, direct_fraction=1.0)["train"]["text"]) == 0
    # the same problems either way: the fraction changes how a problem is told, not which
    half = embedded_dataset("text", sizes, direct_fraction=0.5)["train"]["text"]
    assert 160 <= worked(half) <= 240


class BosTokenizer:
    bos_token = "<|bos|>"


def test_a_pretrained_model_is_asked_as_its_corpus_asks_and_read_up_to_its_first_answer(monkeypatch):
    asked = []

    def answers(model, tokenizer, prompts, max_new_tokens, batch_size):
        asked.extend(prompts)
        # the first goes on into a next document, whose `#### 2` would be read as the answer if not cut off
        return [
            " 7+5=12, 4+8+1=13, 3+0+1=4\n#### 432\nQuestion: What is 1 + 1?\nAnswer: 1+1=2\n#### 2",
            " 3+4=7\n#### 8",
            " 8",
        ]

    monkeypatch.setattr(pretrained, "generate_answers", answers)
    rows = {
        "prompt": [[{"role": "user", "content": q}] for q in ("What is 347 + 85?", "What is 3 + 4?", "What is 5 + 3?")],
        "answer": [432, 7, 8],
    }
    scores = pretrained.pretraining_format_scores(None, BosTokenizer(), rows)
    assert asked == [
        "<|bos|>Question: What is 347 + 85?\nAnswer:",
        "<|bos|>Question: What is 3 + 4?\nAnswer:",
        "<|bos|>Question: What is 5 + 3?\nAnswer:",
    ]
    # right, wrong, right but bare (no working, no `####`: the last number is read, the format is not met)
    assert scores["pretraining_format_correct"] == [1, 0, 1]
    summary = scores["pretraining_format"]
    assert summary["exact_match"] == 2 / 3 and summary["format"] == 2 / 3
    assert summary["prompt"] == "Question: {question}\nAnswer:"
    low, high = summary["exact_match_ci95"]
    assert low < 2 / 3 < high
    assert scores["pretraining_format_samples"][0]["completion"] == " 7+5=12, 4+8+1=13, 3+0+1=4\n#### 432"
