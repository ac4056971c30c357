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
