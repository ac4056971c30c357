"""The embedded sequence-to-sequence task: dates as people write them, normalised to ISO 8601 (`data.dates`)."""

from __future__ import annotations

from ..dates import date_rows
from . import EmbeddedTask, register_task


DATES = register_task(
    EmbeddedTask(
        name="dates",
        formats={"source_target": lambda count, split, seed=0, direct_fraction=0.0: date_rows(count, split, seed)},
        columns={"source_target": ("source", "target")},
        split_by="date",
        scored_format="source_target",
        metric="exact_match",
        scorer="generated_targets",
        dataset_type="plugformer-dates",
        dataset_name="plugformer embedded dates",
        description="plugformer's embedded dates as people write them, normalised to ISO 8601 (\"the 3rd of may, "
        '1999" -> 1999-05-03',
        held_out="The figures hold for the held-out split named in the evaluation, whose dates never occur in "
        "training, however written.",
    )
)
