"""The embedded classification task: a sentiment grammar ("the food was not really good" -> NEGATIVE,
`corpus.sentiment_sentences`)."""

from __future__ import annotations

import random

from ..corpus import SENTIMENT_LABELS, sentiment_sentences
from ..splits import split_of_key
from . import EmbeddedTask, register_task


def sentiment_rows(count: int, split: str, seed: int = 0, direct_fraction: float = 0.0) -> list[dict]:
    """Up to `count` distinct labelled sentences of the sentiment grammar whose split (`split_of_key` of the sentence)
    is `split`, in an order drawn from `seed`. The grammar has 1,792 sentences (about 10% each in dev and test): a
    larger `count` gets every sentence of the split once."""
    rows = [
        {"text": text, "label": SENTIMENT_LABELS[label]}
        for text, label in sentiment_sentences()
        if split_of_key(text) == split
    ]
    random.Random(f"{seed}|{split}").shuffle(rows)
    return rows[:count]


SENTIMENT = register_task(
    EmbeddedTask(
        name="sentiment",
        formats={"classification": sentiment_rows},
        columns={"classification": ("text", "label")},
        split_by="sentence",
        scored_format="classification",
        metric="accuracy",
        scorer="classification",
        dataset_type="plugformer-sentiment",
        dataset_name="plugformer embedded sentiment grammar",
        description='plugformer\'s embedded sentiment grammar ("the food was not really good" -> NEGATIVE',
        held_out="The figures hold for the held-out split named in the evaluation, whose sentences never occur in "
        "training.",
    )
)
