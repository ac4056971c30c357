"""Verifiable rewards (RLVR): plain callables in TRL's reward-function signature.

`f(prompts, completions, **kwargs) -> list[float | None]`; dataset columns such as `answer` (or `solution`, the
name TRL's math datasets give the ground truth) arrive as keyword lists. Completions are strings, or for conversational data `[{"role": "assistant", "content": ...}]`.
"""

from __future__ import annotations

import re
from fractions import Fraction


# the final answer after `####`, or else the last number in the text
_MARKED = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"[-+−]?\s*\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_FORMAT = re.compile(r"\A[^\n#]*\n####[ \t]*[-+]?\d+(?:\.\d+)?[ \t]*\Z")


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion, plain or conversational (the last message's content)."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def parse_number(text: str) -> Fraction | None:
    """The number `text` starts with, exactly (signs, unicode minus, thousands commas, decimals, fractions).

    Examples:

    >>> parse_number(" -1,234.50 apples")
    Fraction(-2469, 2)
    >>> parse_number("− 7") == parse_number("-7")
    True
    >>> parse_number("3/4") == parse_number("0.75")
    True
    >>> parse_number("seven") is None
    True
    """
    match = _NUMBER.search(text)
    if match is None:
        return None
    token = match.group(0).replace("−", "-").replace(" ", "").replace(",", "").lstrip("+")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> Fraction | None:
    """The final answer of a solution: the number after the last `####`, else the last number in the text.

    Examples:

    >>> extract_answer("37 + 45 = 82\\n#### 82")
    Fraction(82, 1)
    >>> extract_answer("12 - 20 = -8\\n####-8 apples, I think")
    Fraction(-8, 1)
    >>> extract_answer("so the total is 1,000.") == 1000
    True
    >>> extract_answer("#### ") is None
    True
    >>> extract_answer("no digits here") is None
    True
    """
    marked = _MARKED.findall(text)
    if marked:
        return parse_number(marked[-1])
    numbers = _NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def final_answer(solution: str) -> str | None:
    """The final answer of a worked solution as text, exactly (`extract_answer`): what an `answer` column would hold.

    Example:

    >>> final_answer("37 + 45 = 82\\n#### 82"), final_answer("42"), final_answer("3/4"), final_answer("none")
    ('82', '42', '3/4', None)
    """
    value = extract_answer(str(solution))
    return None if value is None else str(value)


def ground_truths(answer: list | None, solution: list | None, reward: str) -> list[Fraction | None]:
    """The numbers to match: the `answer` column's, else each worked `solution`'s final answer (TRL's math datasets
    name the ground truth `solution`). Raises `ValueError` naming `reward` when the data holds neither column."""
    if answer is not None:
        return [parse_number(str(truth)) for truth in answer]
    if solution is not None:
        return [extract_answer(str(truth)) for truth in solution]
    raise ValueError(
        f"reward {reward!r} compares completions with the ground truth in an `answer` or a `solution` "
        "column; your data has neither: add one (--rename_columns OLD=answer), or reward with your own "
        "function (--reward_funcs pkg.module:function)"
    )


def exact_match_reward(
    completions: list, answer: list[str] | None = None, solution: list[str] | None = None, **kwargs
) -> list[float]:
    """1.0 where the completion's final answer equals the ground truth as a number, else 0.0. The ground truth is
    `answer`, else the final answer of `solution` (after its last `####`, else its last number).

    Example:

    >>> exact_match_reward(["3 + 4 = 7\\n#### 7", "#### +7.0", "#### 71", "seven"], answer=["7"] * 4)
    [1.0, 1.0, 0.0, 0.0]
    >>> exact_match_reward(["#### 7", "#### 8"], solution=["3 + 4 = 7\\n#### 7", "so 2 * 4 is 8"])
    [1.0, 1.0]
    """
    rewards = []
    for completion, expected in zip(completions, ground_truths(answer, solution, "exact_match"), strict=True):
        predicted = extract_answer(completion_text(completion))
        rewards.append(float(predicted is not None and predicted == expected))
    return rewards


def format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 for a completion made of one worked line then `#### <number>` and nothing after it, else 0.0.

    Example:

    >>> format_reward(["3 + 4 = 7\\n#### 7", "#### 7", "3 + 4 = 7\\n#### 7 done", "3 + 4 = 7\\n#### 7 "])
    [1.0, 0.0, 0.0, 1.0]
    """
    return [float(_FORMAT.match(completion_text(c)) is not None) for c in completions]


def worked_steps(text: str) -> list[str]:
    """The comma-separated steps of a solution's worked line (the text before its first line break); the first
    carries the line's restatement of the problem (`347 + 85: 7+5=12`), so a misread operand costs a step too."""
    line = text.split("\n", 1)[0].strip()
    return [step.strip() for step in line.split(",")] if line else []


def steps_reward(completions: list, solution: list[str], **kwargs) -> list[float]:
    """The fraction of the reference solution's worked steps that the completion writes down, in place.

    A dense verifiable reward: one slipped digit fact (`4*6=25`) costs one step, not the whole answer, so answers
    in one group that all miss the final number still differ, and the step that slipped is the one penalised.
    Divided by the longer of the two step lists, so extra steps cost as much as missing ones.

    Example:

    >>> reference = "347 + 85: 7+5=12, 4+8+1=13, 3+0+1=4\\n#### 432"
    >>> slipped = "347 + 85: 7+5=12, 4+8+1=14, 3+0+1=4\\n#### 442"
    >>> steps_reward([slipped, reference, "347 + 85: 7+5=12\\n#### 12"], solution=[reference] * 3)
    [0.6666666666666666, 1.0, 0.3333333333333333]
    """
    rewards = []
    for completion, truth in zip(completions, solution, strict=True):
        written, expected = worked_steps(completion_text(completion)), worked_steps(str(truth))
        matched = sum(a == b for a, b in zip(written, expected, strict=False))
        rewards.append(matched / max(len(written), len(expected), 1))
    return rewards


def math_verify_reward(
    completions: list, answer: list[str] | None = None, solution: list[str] | None = None, **kwargs
) -> list[float | None]:
    """1.0 where `math-verify` judges the completion equal to the ground truth (`answer`, else `solution`, which it
    parses whole, as TRL's `accuracy_reward` does): LaTeX, fractions, expressions.

    Needs `pip install math-verify`; returns `None` (no reward) for completions it cannot parse.
    """
    truths = answer if answer is not None else solution
    if truths is None:
        ground_truths(None, None, "math_verify")  # raises, naming both columns
    try:
        from math_verify import parse, verify
    except ImportError as error:
        raise ImportError("math_verify_reward needs `pip install math-verify`") from error
    rewards = []
    for completion, truth in zip(completions, truths, strict=True):
        parsed = parse(completion_text(completion))
        rewards.append(float(verify(parse(str(truth)), parsed)) if parsed else None)
    return rewards


REWARD_FUNCTIONS = {
    "exact_match": exact_match_reward,
    "format": format_reward,
    "steps": steps_reward,
    "math_verify": math_verify_reward,
}
