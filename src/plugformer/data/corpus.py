"""A deterministic, offline text corpus for demos and tests: arithmetic facts written as short sentences.

The training pipeline's task generator (train/dev/test splits, SFT conversations, preference pairs) builds on the
same idea; this module only needs text.
"""

from __future__ import annotations

import random


TEMPLATES = (
    "{a} plus {b} is {s}.",
    "{a} + {b} = {s}",
    "The sum of {a} and {b} is {s}.",
    "{s} minus {b} is {a}.",
    "If you add {b} to {a} you get {s}.",
)


def arithmetic_sentences(count: int, seed: int = 0, max_operand: int = 99) -> list[str]:
    """`count` sentences stating `a + b = s` for random operands in [0, max_operand], reproducible from `seed`."""
    if count < 0:
        raise ValueError(f"count={count!r} must be >= 0")
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        sentences.append(rng.choice(TEMPLATES).format(a=a, b=b, s=a + b))
    return sentences


SUBJECTS = ("the movie", "the food", "this book", "the service", "my day", "the concert", "the hotel", "the game")
VERBS = ("was", "is", "seemed", "felt")
POSITIVE = ("great", "wonderful", "good", "excellent", "lovely", "fun", "delightful")
NEGATIVE = ("awful", "bad", "terrible", "boring", "horrible", "dull", "disappointing")
SENTIMENT_LABELS = {0: "NEGATIVE", 1: "POSITIVE"}


def sentiment_examples(count: int, seed: int = 0) -> list[tuple[str, int]]:
    """`count` (sentence, label) pairs from a tiny lexicon grammar: "the food was not really good" -> 0.

    The label is the adjective's polarity, flipped by "not": a model has to combine two words that can be far apart,
    so a bag of words is not enough. Labels: 0 = NEGATIVE, 1 = POSITIVE.
    """
    if count < 0:
        raise ValueError(f"count={count!r} must be >= 0")
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        positive = rng.random() < 0.5
        negated = rng.random() < 0.4
        words = [rng.choice(SUBJECTS), rng.choice(VERBS)]
        words += ["not"] * negated + ["really"] * (rng.random() < 0.3)
        words.append(rng.choice(POSITIVE if positive else NEGATIVE))
        examples.append((" ".join(words), int(positive != negated)))
    return examples


def sentiment_sentences() -> list[tuple[str, int]]:
    """Every (sentence, label) of `sentiment_examples`' grammar, once each, in a fixed order."""
    import itertools

    sentences = []
    for subject, verb, negated, really, positive in itertools.product(
        SUBJECTS, VERBS, (False, True), (False, True), (True, False)
    ):
        for adjective in POSITIVE if positive else NEGATIVE:
            words = [subject, verb] + ["not"] * negated + ["really"] * really + [adjective]
            sentences.append((" ".join(words), int(positive != negated)))
    return sentences


NLI_LABELS = {0: "entailment", 1: "neutral", 2: "contradiction"}
_PEOPLE = ("the man", "the woman", "a child", "the teacher", "a doctor", "the farmer", "my friend", "the pilot")
_ACTIONS = ("running", "reading", "cooking", "singing", "sleeping", "painting", "swimming", "working")
_PLACES = ("park", "kitchen", "garden", "library", "office", "station", "museum", "house")
_EXTRAS = ("with a friend", "after lunch", "for an hour", "because it is late", "again today")


def nli_examples(count: int, seed: int = 0) -> list[tuple[str, str, int]]:
    """`count` (premise, hypothesis, label) triples; 0 entailment, 1 neutral, 2 contradiction (MNLI's order).

    The label is decidable from word overlap and negation: an entailed hypothesis drops part of the premise, a
    contradiction negates it, a neutral one adds information the premise does not have.
    """
    if count < 0:
        raise ValueError(f"count={count!r} must be >= 0")
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        person, action, place = rng.choice(_PEOPLE), rng.choice(_ACTIONS), rng.choice(_PLACES)
        premise = f"{person} is {action} in the {place}"
        label = rng.randrange(3)
        claim = rng.choice((f"is {action}", f"is in the {place}"))
        if label == 0:
            hypothesis = f"{person} {claim}"
        elif label == 2:
            hypothesis = f"{person} {claim.replace('is', 'is not', 1)}"
        else:
            hypothesis = f"{person} {claim} {rng.choice(_EXTRAS)}"
        examples.append((premise, hypothesis, label))
    return examples
