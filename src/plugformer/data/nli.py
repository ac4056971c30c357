"""The embedded natural language inference task: premise, hypothesis, entailment / neutral / contradiction.

A premise says who does what to whom, and where: "the man is helping the woman in the park". Each hypothesis is one
of fifteen templates, five per label (`HYPOTHESES`):

- entailment: the premise itself; "the man is in the park"; "the woman is in the park"; "someone is helping the
  woman"; "the man is helping someone";
- contradiction: "the man is not helping the woman"; "the man is not in the park"; "nobody is helping the woman";
  "the man is in the office"; "the woman is in the office";
- neutral: "the woman is helping the man in the park" (roles swapped); "the man is helping the woman after lunch";
  "the man is helping the girl"; "the girl is helping the woman"; "the girl is in the park"

(one place at a time: a person in the park is in no other place). The swapped roles have the premise's words
exactly: a model that reads each sentence as a bag of words, as the decomposable attention model without
intra-sentence attention does, cannot tell them from the premise itself, so it answers at most half of those two
templates right (at most 14/15 of the task, 93.3%). Only word order decides them, which that model reads through
intra-sentence attention's distance biases alone (model_cards/nli-grammar/RESULTS.md: learned in one run of six).

The generator needs no network and is deterministic. A row's split is a hash of its premise (`splits.split_of_key`),
so a premise seen in training never occurs in dev or test, with any hypothesis; about 10% of the 5,760 premises fall
in each held-out split.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .splits import SPLITS, split_of_key


PEOPLE = ("the man", "the woman", "the boy", "the girl", "the teacher", "the doctor", "the farmer", "the pilot",
          "the nurse", "the child")  # fmt: skip
VERBS = ("helping", "watching", "calling", "following", "teaching", "greeting", "pushing", "thanking")
PLACES = ("park", "kitchen", "garden", "library", "office", "station", "museum", "house")
EXTRAS = ("after lunch", "for an hour", "with a smile", "again today", "every morning")
LABELS = ("entailment", "neutral", "contradiction")


def premise(subject: str, verb: str, obj: str, place: str) -> str:
    return f"{subject} is {verb} {obj} in the {place}"


def _other(rng: random.Random, choices: tuple[str, ...], *taken: str) -> str:
    return rng.choice([choice for choice in choices if choice not in taken])


# hypothesis templates per label: (subject, verb, object, place, rng) -> hypothesis
Template = Callable[[str, str, str, str, random.Random], str]
HYPOTHESES: dict[str, tuple[Template, ...]] = {
    "entailment": (
        lambda a, v, b, p, rng: f"{a} is {v} {b} in the {p}",
        lambda a, v, b, p, rng: f"{a} is in the {p}",
        lambda a, v, b, p, rng: f"{b} is in the {p}",
        lambda a, v, b, p, rng: f"someone is {v} {b}",
        lambda a, v, b, p, rng: f"{a} is {v} someone",
    ),
    "contradiction": (
        lambda a, v, b, p, rng: f"{a} is not {v} {b}",
        lambda a, v, b, p, rng: f"{a} is not in the {p}",
        lambda a, v, b, p, rng: f"nobody is {v} {b}",
        lambda a, v, b, p, rng: f"{a} is in the {_other(rng, PLACES, p)}",
        lambda a, v, b, p, rng: f"{b} is in the {_other(rng, PLACES, p)}",
    ),
    "neutral": (
        lambda a, v, b, p, rng: f"{b} is {v} {a} in the {p}",  # roles swapped: the premise's words, reordered
        lambda a, v, b, p, rng: f"{a} is {v} {b} {rng.choice(EXTRAS)}",
        lambda a, v, b, p, rng: f"{a} is {v} {_other(rng, PEOPLE, a, b)}",
        lambda a, v, b, p, rng: f"{_other(rng, PEOPLE, a, b)} is {v} {b}",
        lambda a, v, b, p, rng: f"{_other(rng, PEOPLE, a, b)} is in the {p}",
    ),
}


def premises(split: str) -> list[tuple[str, str, str, str]]:
    """Every (subject, verb, object, place) whose premise belongs to `split`, in a fixed order."""
    return [
        (a, v, b, p)
        for a in PEOPLE
        for v in VERBS
        for b in PEOPLE
        if b != a
        for p in PLACES
        if split_of_key(premise(a, v, b, p)) == split
    ]


def nli_rows(count: int, split: str, seed: int = 0) -> list[dict]:
    """Up to `count` distinct rows `{"text": premise, "text_pair": hypothesis, "label": ...}` whose premises belong to
    `split`, drawn from `seed`: the labels in turn (as many of each, to one), each row one of its label's templates
    for a random premise, then shuffled. A `count` beyond the split's distinct rows gets fewer.

    >>> [row["text_pair"] for row in nli_rows(2, "test")]
    ['the boy is thanking the nurse', 'the teacher is in the kitchen']
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r} must be a non-negative int")
    rng = random.Random(f"nli|{seed}|{split}")
    facts = premises(split)
    rows, seen = [], set()
    for _ in range(20 * count):  # a duplicate is drawn again; the split holds far more distinct rows than asked for
        if len(rows) == count:
            break
        label = LABELS[len(rows) % len(LABELS)]  # balanced labels, shuffled below
        a, v, b, p = rng.choice(facts)
        hypothesis = rng.choice(HYPOTHESES[label])(a, v, b, p, rng)
        key = (premise(a, v, b, p), hypothesis)
        if key not in seen:
            seen.add(key)
            rows.append({"text": key[0], "text_pair": hypothesis, "label": label})
    rng.shuffle(rows)
    return rows
