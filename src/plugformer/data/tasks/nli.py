"""The embedded natural language inference task: premise, hypothesis, entailment / neutral / contradiction
(`data.nli`)."""

from __future__ import annotations

from ..nli import nli_rows
from . import EmbeddedTask, register_task


NLI = register_task(
    EmbeddedTask(
        name="nli",
        formats={"sentence_pair": lambda count, split, seed=0, direct_fraction=0.0: nli_rows(count, split, seed)},
        columns={"sentence_pair": ("text", "text_pair", "label")},
        split_by="premise",
        scored_format="sentence_pair",
        metric="accuracy",
        scorer="classification",
        dataset_type="plugformer-nli",
        dataset_name="plugformer embedded inference grammar",
        description='plugformer\'s embedded inference grammar ("the man is helping the woman in the park" / "the '
        'woman is helping the man in the park" -> neutral',
        held_out="The figures hold for the held-out split named in the evaluation, whose premises never occur in "
        "training.",
    )
)
