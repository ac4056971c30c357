"""The embedded arithmetic task: sums, differences and products told as bare sums or word problems, with verifiable
answers, in every format the language-model stages read (the generator: `data.sources`)."""

from __future__ import annotations

from ..sources import FORMAT_ROWS, format_rows, generate_problems
from . import EmbeddedTask, register_task


def rows_of(data_format: str):
    """The rows function of one of the arithmetic formats (`sources.FORMAT_ROWS`)."""

    def rows(count: int, split: str, seed: int = 0, direct_fraction: float = 0.0) -> list[dict]:
        return format_rows(data_format, generate_problems(count, split, seed), seed, direct_fraction)

    return rows


ARITHMETIC = register_task(
    EmbeddedTask(
        name="arithmetic",
        formats={data_format: rows_of(data_format) for data_format in FORMAT_ROWS},
        columns={
            "text": ("text",),
            "conversation": ("prompt", "completion"),
            "preference": ("prompt", "chosen", "rejected"),
            "prompt": ("prompt", "answer", "solution"),
            "prompt_answer": ("prompt", "answer", "solution"),
        },
        split_by="arithmetic fact",
        scored_format="prompt_answer",
        metric="exact_match",
        scorer="exact_match",
        dataset_type="plugformer-arithmetic",
        dataset_name="plugformer embedded arithmetic",
        description="plugformer's embedded arithmetic generator (sums, differences, products and word problems",
        held_out="Exact-match figures hold for the held-out split named in the evaluation, whose facts never occur "
        "in training.",
    )
)
