"""The embedded tasks: one registered `EmbeddedTask` record per task, read by the data loader (`sources`), the
evaluation (`plugformer eval`, `plugformer compare`) and the model cards, none of which tests a task's name.

A task is the data a stage trains on without `--dataset_name`: arithmetic with verifiable answers, a sentiment grammar,
dates to normalise, an inference grammar. Each task's own module (`data/tasks/dates.py`, ...) builds its record and
registers it with `register_task`; a duplicate name, or a data format another task already generates, raises. A
data format names its task: `load_stage_dataset("source_target")` without a source is the dates' rows, and
`plugformer eval` scores a model on the task of the format its run recorded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass


# (count, split, seed, direct_fraction) -> rows: `count` rows of `split` drawn from `seed`; `direct_fraction` is the
# share of answers that skip the working (`StageArguments.direct_answer_fraction`), ignored by a task without working
RowsFunction = Callable[[int, str, int, float], list[dict]]


@dataclass(frozen=True, kw_only=True)
class EmbeddedTask:
    """One embedded task.

    Args:
        name (`str`): The task's name, which a stage's card names (`StageCard.embedded_task`).
        formats (`Mapping[str, RowsFunction]`): Each data format it generates (`Stage.data_format`, TRL's dataset
            formats) with its rows function, `rows(count, split, seed, direct_fraction) -> list[dict]`.
        columns (`Mapping[str, tuple[str, ...]]`): The columns of each format's rows.
        split_by (`str`): What a row's split is a hash of (`splits.split_of_key`), e.g. `"sentence"`: a held-out
            row's key never occurs in training.
        scored_format (`str`): The format whose held-out rows `plugformer eval` scores, one of `formats`.
        metric (`str`): The headline score of those rows in `plugformer eval`'s results, e.g. `"exact_match"`.
        scorer (`str`): How those rows are scored, a key of `plugformer.evaluation.evaluators.TASK_SCORERS`:
            `"exact_match"` (greedy answers of a language model), `"classification"` (predicted labels) or
            `"generated_targets"` (an encoder-decoder's generated targets).
        dataset_type (`str`): The model-index `dataset_type` of the scores on its cards.
        dataset_name (`str`): The model-index `dataset_name`.
        description (`str`): The card's description of the data, before its split rule.
        held_out (`str`): The card's sentence on what the held-out figures mean.
    """

    name: str
    formats: Mapping[str, RowsFunction]
    columns: Mapping[str, tuple[str, ...]]
    split_by: str
    scored_format: str
    metric: str
    scorer: str
    dataset_type: str
    dataset_name: str
    description: str
    held_out: str

    @property
    def card_text(self) -> str:
        """The card's text on the data (without the closing parenthesis, after which the card adds its sizes)."""
        return f"{self.description}; train/dev/test split by {self.split_by}"

    def rows(self, data_format: str, count: int, split: str, seed: int = 0, direct_fraction: float = 0.0):
        """`count` rows of `split` in `data_format` (see `RowsFunction`)."""
        if data_format not in self.formats:
            raise ValueError(f"task {self.name!r} has no {data_format!r} data; its formats: {list(self.formats)}")
        return self.formats[data_format](count, split, seed, direct_fraction)


class TaskTable(Mapping[str, EmbeddedTask]):
    """The registered embedded tasks by name, in registration order."""

    def __init__(self):
        self._table: dict[str, EmbeddedTask] = {}

    def register(self, task: EmbeddedTask) -> EmbeddedTask:
        """Adds `task`; a name or a data format already registered raises instead of silently replacing it."""
        if not isinstance(task, EmbeddedTask):
            raise ValueError(f"register_task: expected an EmbeddedTask record, got {type(task).__name__}")
        if not task.name or not isinstance(task.name, str):
            raise ValueError(f"task name={task.name!r}: expected a non-empty string")
        if task.name in self._table:
            raise ValueError(f"task {task.name!r} is already registered ({self._table[task.name].dataset_name})")
        if set(task.columns) != set(task.formats):
            raise ValueError(
                f"task {task.name!r}: columns name the formats {sorted(task.columns)}, its generators "
                f"{sorted(task.formats)}; give the columns of each format it generates"
            )
        if task.scored_format not in task.formats:
            raise ValueError(
                f"task {task.name!r}: scored_format={task.scored_format!r} is none of its formats {list(task.formats)}"
            )
        for data_format in task.formats:
            owner = self.task_of_format(data_format, missing_ok=True)
            if owner is not None:
                raise ValueError(
                    f"task {task.name!r}: the embedded {data_format!r} data is already task {owner.name!r}'s; "
                    "a format names one task"
                )
        self._table[task.name] = task
        return task

    def get_task(self, name: str) -> EmbeddedTask:
        """The record of `name`; an unknown name raises a `ValueError` listing the tasks."""
        if name not in self._table:
            raise ValueError(f"unknown embedded task {name!r}; tasks: {list(self._table)}")
        return self._table[name]

    def task_of_format(self, data_format: str, missing_ok: bool = False) -> EmbeddedTask | None:
        """The task whose rows `data_format` is; an unknown format raises a `ValueError` listing the formats (`None`
        with `missing_ok`)."""
        for task in self._table.values():
            if data_format in task.formats:
                return task
        if missing_ok:
            return None
        formats = sorted(name for task in self._table.values() for name in task.formats)
        raise ValueError(f"data format {data_format!r} has no embedded data; formats: {formats}")

    def __getitem__(self, name: str) -> EmbeddedTask:
        return self._table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


TASKS = TaskTable()


def register_task(task: EmbeddedTask) -> EmbeddedTask:
    """Registers `task` in `TASKS` (see `TaskTable.register`) and returns it."""
    return TASKS.register(task)


# the modules that register the shipped tasks; each registers its record on import
TASK_MODULES = ("arithmetic", "sentiment", "dates", "nli")
for _module in TASK_MODULES:
    importlib.import_module(f".{_module}", __name__)
