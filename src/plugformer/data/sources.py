"""Training data for every stage: an embedded task (`data.tasks`: this module's generator of arithmetic with
verifiable answers, or another task's), or any `datasets` source.

The generator needs no network and is deterministic. A problem is an arithmetic fact (operation, a, b) told as
a bare sum or as a short word problem; its split (train / dev / test) is a function of the fact alone, so a
fact seen in training never appears in dev or test, whatever the phrasing and however many examples are drawn.
Each stage gets the same problems in the format its record names (TRL's dataset formats):

| format | read by | columns |
|---|---|---|
| text | pretrain | `text` (facts and worked problems as plain text) |
| conversation | sft | `prompt`, `completion` (conversational: completion-only loss) |
| preference | reward, dpo | `prompt`, `chosen`, `rejected` (correct vs wrong answer) |
| prompt, prompt_answer | rlhf, grpo; dev selection and scoring | `prompt`, `answer`, `solution` (ground truth reaching the reward functions) |
| classification | classify | `text`, `label` (and `text_pair` if given): the embedded data is a sentiment grammar instead |
| source_target | seq2seq | `source`, `target`: the embedded data is dates normalised to ISO 8601 instead |
| sentence_pair | nli | `text` (premise), `text_pair` (hypothesis), `label`: an inference grammar instead |

(The embedded data of a format is the task that registers it, `data.tasks.TASKS.task_of_format`.)

An answer is a worked line followed by the final answer after `####` (the GSM8K convention):
`37 + 45: 7+5=12, 3+4+1=8\\n#### 82`. With `direct_fraction` > 0, that share of the SFT answers is the bare result
(`#### 82`) and that share of the rejected preference answers a bare near miss: demonstrations that skip the
working, which RL with verifiable rewards learns to overcome. In the pretraining text, that share of the problems
never shows the column method: a bare answer, or the problem's one-digit facts alone (`unworked_texts`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from datasets import Dataset, DatasetDict

from .splits import SPLITS, split_of_key
from .user_data import load_user_splits
from .validation import refusing_hub_ids_offline


ANSWER_MARKER = "####"
NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun")
ITEMS = ("apples", "books", "coins", "marbles", "pens", "shells", "stamps", "cards")


@dataclass(frozen=True)
class Problem:
    """One arithmetic fact in one phrasing; `answer` is the exact integer result."""

    operation: str
    a: int
    b: int
    question: str

    @property
    def answer(self) -> int:
        return OPERATIONS[self.operation][1](self.a, self.b)

    @property
    def steps(self) -> list[str]:
        """The digit-wise worked steps, lowest digit first (see `worked_steps`)."""
        return worked_steps(self.operation, self.a, self.b)

    @property
    def worked_line(self) -> str:
        """The problem restated, then its steps (`347 + 85: 7+5=12, ...`): see `worked_line`."""
        return worked_line(self, self.steps)

    @property
    def solution(self) -> str:
        return f"{self.worked_line}\n{ANSWER_MARKER} {self.answer}"

    @property
    def direct(self) -> str:
        """The answer without the working (`#### 432`): what a writer who skips the steps hands in."""
        return f"{ANSWER_MARKER} {self.answer}"

    @property
    def split(self) -> str:
        return split_of(self.operation, self.a, self.b)


# operation -> (symbol, result, operand range for a, operand range for b); subtraction keeps a >= b
OPERATIONS: dict[str, tuple[str, Callable[[int, int], int], range, range]] = {
    "add": ("+", lambda a, b: a + b, range(1000), range(1000)),
    "sub": ("-", lambda a, b: a - b, range(1000), range(1000)),
    "mul": ("*", lambda a, b: a * b, range(1000), range(10)),
}

# (operation, template)
QUESTION_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("add", "What is {a} + {b}?"),
    ("sub", "What is {a} - {b}?"),
    ("mul", "What is {a} * {b}?"),
    ("add", "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"),
    ("sub", "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"),
    ("mul", "{name} has {a} bags with {b} {item} in each. How many {item} are there in total?"),
)


def _digits(number: int, count: int) -> list[int]:
    """The `count` lowest decimal digits of `number`, lowest first (zeros beyond its length)."""
    return [number // 10**i % 10 for i in range(count)]


def worked_steps(operation: str, a: int, b: int) -> list[str]:
    """Column arithmetic, one step per digit of `a` from the lowest: what a pupil writes down.

    A step shows the two digits, the carry (or borrow) from the step before, and the step's value; addition and
    multiplication carry `value // 10`, subtraction borrows 1 when it has to add 10. Every step is a one-digit fact,
    so the skill is the same on every problem: a model that learns it answers problems it never saw. A
    multiplication step with a carry writes the product first (`4*6=24+4=28`): one fact per written number, as in
    the other operations, instead of a product and a sum in one (`4*6+4=28`, the fact models learned last).

    Examples:

    >>> worked_steps("add", 347, 85)
    ['7+5=12', '4+8+1=13', '3+0+1=4']
    >>> worked_steps("sub", 432, 85)
    ['2-5+10=7', '3-8-1+10=4', '4-0-1=3']
    >>> worked_steps("mul", 347, 6)
    ['7*6=42', '4*6=24+4=28', '3*6=18+2=20']
    """
    width = max(len(str(a)), len(str(b)) if operation != "mul" else 1)
    digits_a, digits_b = _digits(a, width), _digits(b, width)
    steps, carry = [], 0
    for x, y in zip(digits_a, digits_b, strict=True):
        if operation == "add":
            value = x + y + carry
            steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={value}")
            carry = value // 10
        elif operation == "sub":
            value = x - y - carry
            borrow = int(value < 0)
            steps.append(
                f"{x}-{y}" + (f"-{carry}" if carry else "") + ("+10" if borrow else "") + f"={value + 10 * borrow}"
            )
            carry = borrow
        else:
            value = x * b + carry
            steps.append(f"{x}*{b}" + (f"={x * b}+{carry}" if carry else "") + f"={value}")
            carry = value // 10
    return steps


def worked_line(problem: Problem, steps: list[str]) -> str:
    """The problem restated as `a op b:`, then its steps: the operands' last digits sit just before ` op` and `:`,
    the same few tokens back in every phrasing, which is where each step reads its digits (read from the question
    alone, that lookup was the skill a model learned last: see model_cards/pipeline-tiny/RESULTS.md).

    Example:

    >>> worked_line(Problem("add", 347, 85, "What is 347 + 85?"), ["7+5=12", "4+8+1=13", "3+0+1=4"])
    '347 + 85: 7+5=12, 4+8+1=13, 3+0+1=4'
    """
    return f"{problem.a} {OPERATIONS[problem.operation][0]} {problem.b}: {', '.join(steps)}"


def answer_from_steps(operation: str, steps: list[str]) -> int:
    """The number column arithmetic writes down from `steps`: each step's last digit, the last step whole.

    >>> answer_from_steps("add", ["7+5=12", "4+8+1=13", "3+0+1=4"])
    432
    """
    values = [int(step.rsplit("=", 1)[1]) for step in steps]
    if operation == "sub":
        return int("".join(str(v) for v in reversed(values)))
    return int(str(values[-1]) + "".join(str(v % 10) for v in reversed(values[:-1])))


def split_of(operation: str, a: int, b: int, dev_percent: int = 10, test_percent: int = 10) -> str:
    """The fixed split of an arithmetic fact: a hash of the fact, so splits never change and never overlap.

    Example:

    >>> split_of("add", 37, 45) == split_of("add", 37, 45)
    True
    """
    return split_of_key(f"{operation}|{a}|{b}", dev_percent, test_percent)


def _operand(rng: random.Random, values: range) -> int:
    """An operand with a uniformly drawn number of digits (1, 2 or 3), so short and long problems both occur."""
    width = rng.randint(1, len(str(values[-1])))
    return rng.randrange(0 if width == 1 else 10 ** (width - 1), min(10**width, values[-1] + 1))


def generate_problems(count: int, split: str, seed: int = 0) -> list[Problem]:
    """`count` problems whose facts belong to `split`, drawn deterministically from `seed`."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    if not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r} must be a non-negative int")
    rng = random.Random(f"{seed}|{split}")
    problems = []
    while len(problems) < count:
        operation, template = rng.choice(QUESTION_TEMPLATES)
        _, _, range_a, range_b = OPERATIONS[operation]
        a, b = _operand(rng, range_a), _operand(rng, range_b)
        if operation == "sub" and b > a:
            a, b = b, a
        if split_of(operation, a, b) != split:
            continue
        question = template.format(a=a, b=b, name=rng.choice(NAMES), item=rng.choice(ITEMS))
        problems.append(Problem(operation, a, b, question))
    return problems


def near_miss(answer: int, rng: random.Random) -> int:
    """A misread final answer: off by 1, 10 or 100 in either direction, never negative."""
    slip = rng.choice((-10, -1, 1, 10, 100))
    return answer + slip if answer + slip >= 0 else answer + abs(slip)


def wrong_answer(problem: Problem, rng: random.Random, direct_fraction: float = 0.0) -> str:
    """A plausible wrong solution: with probability `direct_fraction` a bare near-miss answer (`#### 442`, the
    working skipped); else in the worked format, with one step's value off by one and the final answer read from
    the slipped steps (three in four), or right steps with a misread final answer."""
    if direct_fraction and rng.random() < direct_fraction:
        return f"{ANSWER_MARKER} {near_miss(problem.answer, rng)}"
    steps = problem.steps
    if rng.random() < 0.25:
        return f"{worked_line(problem, steps)}\n{ANSWER_MARKER} {near_miss(problem.answer, rng)}"
    index = rng.randrange(len(steps))
    head, value = steps[index].rsplit("=", 1)
    delta = rng.choice((-1, 1)) if int(value) > 0 else 1
    slipped = [*steps[:index], f"{head}={int(value) + delta}", *steps[index + 1 :]]
    return f"{worked_line(problem, slipped)}\n{ANSWER_MARKER} {answer_from_steps(problem.operation, slipped)}"


def pretraining_texts(problem: Problem, rng: random.Random) -> str:
    """A plain-text document: a worked problem, or its steps as sentences (the corpus teaches the one-digit facts
    and the column layout; the chat format comes with SFT)."""
    symbol = OPERATIONS[problem.operation][0]
    return rng.choice(
        (
            f"{problem.worked_line}, so {problem.a} {symbol} {problem.b} = {problem.answer}.",
            f"{pretraining_prompt(problem.question)} {problem.solution}",
        )
    )


def unworked_texts(problem: Problem, rng: random.Random) -> str:
    """A plain-text document that never shows the column method: the problem with its bare answer, or its one-digit
    facts in random order with no problem around them (the facts stay learnable, the working does not).

    Example:

    >>> problem = Problem("add", 347, 85, "What is 347 + 85?")
    >>> unworked_texts(problem, random.Random(1))
    'Question: What is 347 + 85?\\nAnswer: #### 432'
    """
    if rng.random() < 0.5:
        return f"{pretraining_prompt(problem.question)} {problem.direct}"
    facts = problem.steps
    rng.shuffle(facts)
    return ", ".join(facts) + "."


def pretraining_prompt(question: str) -> str:
    """A question as the pretraining corpus writes it, up to its answer: how `plugformer eval` also asks a model
    trained on that text alone, which never saw the chat template.

    Example:

    >>> pretraining_prompt("What is 2 + 3?")
    'Question: What is 2 + 3?\\nAnswer:'
    """
    return f"Question: {question}\nAnswer:"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def demonstration(problem: Problem, rng: random.Random, direct_fraction: float) -> str:
    """An SFT answer: the bare answer with probability `direct_fraction`, else the worked solution."""
    return problem.direct if direct_fraction and rng.random() < direct_fraction else problem.solution


def text_row(problem: Problem, rng: random.Random, direct_fraction: float) -> dict:
    """A pretraining document; with probability `direct_fraction` one that skips the working (`unworked_texts`)."""
    if direct_fraction and rng.random() < direct_fraction:
        return {"text": unworked_texts(problem, rng)}
    return {"text": pretraining_texts(problem, rng)}


def conversation_row(problem: Problem, rng: random.Random, direct_fraction: float) -> dict:
    return {"prompt": user(problem.question), "completion": assistant(demonstration(problem, rng, direct_fraction))}


def preference_row(problem: Problem, rng: random.Random, direct_fraction: float) -> dict:
    return {
        "prompt": user(problem.question),
        "chosen": assistant(problem.solution),
        "rejected": assistant(wrong_answer(problem, rng, direct_fraction)),
    }


def prompt_row(problem: Problem, rng: random.Random, direct_fraction: float) -> dict:
    return {"prompt": user(problem.question), "answer": str(problem.answer), "solution": problem.solution}


# TRL's dataset formats, which a stage's record names (`Stage.data_format`): each format's embedded rows, and the
# columns it needs from any dataset (`conversation`: one of TRL's SFT column sets, checked by `data.validation`)
FORMAT_ROWS: dict[str, Callable[[Problem, random.Random, float], dict]] = {
    "text": text_row,
    "conversation": conversation_row,
    "preference": preference_row,
    "prompt": prompt_row,
    "prompt_answer": prompt_row,  # a prompt with its ground truth: dev selection and held-out scoring
}


def format_rows(data_format: str, problems: list[Problem], seed: int, direct_fraction: float = 0.0) -> list[dict]:
    """The rows of one data format (see the module docstring for the columns); `direct_fraction` of the SFT
    answers and of the rejected preference answers skip the working (see `StageArguments.direct_answer_fraction`)."""
    if data_format not in FORMAT_ROWS:
        raise ValueError(f"data format {data_format!r} has no embedded data; formats: {sorted(FORMAT_ROWS)}")
    rng = random.Random(seed)
    return [FORMAT_ROWS[data_format](problem, rng, direct_fraction) for problem in problems]


def embedded_dataset(
    data_format: str, sizes: dict[str, int], seed: int = 0, direct_fraction: float = 0.0
) -> DatasetDict:
    """The embedded task that generates `data_format` (`data.tasks`), with `sizes[split]` examples per split."""
    from .tasks import TASKS  # the task modules import this module's arithmetic generator

    if not 0.0 <= direct_fraction <= 1.0:
        raise ValueError(f"direct_answer_fraction={direct_fraction!r} must lie in [0, 1]")
    task = TASKS.task_of_format(data_format)
    return DatasetDict(
        {
            split: Dataset.from_list(task.rows(data_format, count, split, seed, direct_fraction))
            for split, count in sizes.items()
            if count > 0
        }
    )


def load_stage_dataset(
    data_format: str,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    data_files: list[str] | None = None,
    sizes: dict[str, int] | None = None,
    seed: int = 0,
    direct_fraction: float = 0.0,
    rename_columns: str | None = None,
    keep_duplicates: bool = False,
    data_cache_dir: str | None = None,
    held_out_fraction: float | None = None,
) -> DatasetDict:
    """The data a stage reads, in its TRL format, with `train`/`dev`/`test` splits.

    Args:
        data_format (`str`): A key of `FORMAT_COLUMNS`: `text`, `conversation`, `preference`, `prompt` or
            `prompt_answer` (a stage's record names its format).
        dataset_name (`str`, *optional*): Anything `datasets.load_dataset` takes — a local directory, a builder name
            (`json`, `csv`, `text`, `parquet`) with `data_files`, or a Hub id when online. `None` uses the embedded
            task that generates `data_format` (`data.tasks`).
        dataset_config (`str`, *optional*): The dataset's configuration name.
        data_files (`list[str]`, *optional*): Local files for a builder such as `json`.
        sizes (`dict[str, int]`, *optional*): Examples per split for the embedded data; for other data, the
            sizes of `dev`/`test` carved from `train` when the source has no such split.
        seed (`int`, *optional*, defaults to 0): Generation seed / split seed.
        direct_fraction (`float`, *optional*, defaults to 0): Embedded data: the fraction of SFT answers and of
            rejected preference answers that give the bare answer, without the working.
        rename_columns (`str`, *optional*): Your data's columns under the names the format reads,
            `"document=source,summary=target"` (`column_renames`), renamed in every split before anything is read.
        keep_duplicates (`bool`, *optional*, defaults to `False`): Keep the rows of train identical to a held-out
            row (by default dropped and counted: `identity.carve`).
        data_cache_dir (`str`, *optional*): Where the files' digests are kept (`data.identity.cache_root`).
        held_out_fraction (`float`, *optional*): Your data: the `dev`/`test` sizes are caps, each carved split
            holding at most this share of the distinct rows (`identity.held_out_sizes`); `None`: the sizes as given.

    Your data comes back with `.identity` (`data_identity`): its files' digests, the held-out splits' digests and
    row keys, the duplicates dropped; `run_info.json` records it.
    """
    sizes = dict(sizes or {"train": 2000, "dev": 200, "test": 200})
    if dataset_name is None:
        return embedded_dataset(data_format, sizes, seed, direct_fraction)
    with refusing_hub_ids_offline(dataset_name):
        return load_user_splits(
            data_format,
            dataset_name,
            dataset_config,
            data_files,
            sizes,
            seed,
            rename_columns,
            keep_duplicates,
            data_cache_dir,
            held_out_fraction=held_out_fraction,
        )
