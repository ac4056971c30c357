"""The embedded sequence-to-sequence task: dates as people write them, normalised to ISO 8601.

"Tuesday, 3 May 1999", "the 3rd of may, 1999" and "05/03/1999" all become `1999-05-03`: the classic task for
showing what cross-attention learns (each output digit attends to the day, the month name or the year it copies or
translates). The generator needs no network and is deterministic. A date's split is a hash of the date itself
(`sources.split_of_key` of its ISO form), so a date seen in training never occurs in dev or test, however it is
written; about 10% of the 73,049 days of 1900-2099 fall in each held-out split.
"""

from __future__ import annotations

import datetime
import random

from .splits import SPLITS, split_of_key


FIRST_DAY = datetime.date(1900, 1, 1)
DAYS = (datetime.date(2099, 12, 31) - FIRST_DAY).days + 1
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")  # fmt: skip
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def ordinal(day: int) -> str:
    """`day` with its English ordinal suffix.

    >>> [ordinal(d) for d in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 31)]
    ['1st', '2nd', '3rd', '4th', '11th', '12th', '13th', '21st', '22nd', '23rd', '31st']
    """
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


ONES = ("", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")  # fmt: skip
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                 "nine": "ninth", "twelve": "twelfth"}  # fmt: skip


def number_words(number: int) -> str:
    """0 < `number` < 100 in English words.

    >>> number_words(7), number_words(40), number_words(93)
    ('seven', 'forty', 'ninety-three')
    """
    if number < 20:
        return ONES[number]
    return TENS[number // 10] + (f"-{ONES[number % 10]}" if number % 10 else "")


def ordinal_words(number: int) -> str:
    """0 < `number` < 100 as an English ordinal in words.

    >>> ordinal_words(1), ordinal_words(12), ordinal_words(20), ordinal_words(23)
    ('first', 'twelfth', 'twentieth', 'twenty-third')
    """
    words = number_words(number)
    head, _, last = words.rpartition("-")
    if last in ORDINAL_WORDS:
        last = ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return f"{head}-{last}" if head else last


def year_words(year: int) -> str:
    """A year of 1900-2099 as it is read aloud.

    >>> [year_words(y) for y in (1900, 1905, 1993)]
    ['nineteen hundred', 'nineteen oh five', 'nineteen ninety-three']
    >>> [year_words(y) for y in (2000, 2007, 2024)]
    ['two thousand', 'two thousand and seven', 'twenty twenty-four']
    """
    century, rest = divmod(year, 100)
    if century == 20 and rest < 10:
        return "two thousand" + (f" and {ONES[rest]}" if rest else "")
    tail = "hundred" if rest == 0 else f"oh {ONES[rest]}" if rest < 10 else number_words(rest)
    return f"{number_words(century)} {tail}"


# each template writes one date; the numeric one is month first (US), the only numeric convention, so no date reads
# two ways
TEMPLATES = (
    lambda d: f"{d.day} {MONTHS[d.month - 1]} {d.year}",
    lambda d: f"{MONTHS[d.month - 1]} {d.day}, {d.year}",
    lambda d: f"{WEEKDAYS[d.weekday()]}, {MONTHS[d.month - 1]} {d.day}, {d.year}",
    lambda d: f"{WEEKDAYS[d.weekday()][:3]} {d.day} {MONTHS[d.month - 1][:3]} {d.year}",
    lambda d: f"the {ordinal(d.day)} of {MONTHS[d.month - 1].lower()}, {d.year}",
    lambda d: f"{ordinal(d.day)} {MONTHS[d.month - 1]} {d.year}",
    lambda d: f"{MONTHS[d.month - 1][:3]} {ordinal(d.day)} {d.year}",
    lambda d: f"{d.month:02d}/{d.day:02d}/{d.year}",
    lambda d: f"{d.year} {MONTHS[d.month - 1].upper()} {d.day:02d}",
    lambda d: f"{d.day} {MONTHS[d.month - 1][:3].lower()} {d.year}",
    lambda d: f"the {ordinal_words(d.day)} of {MONTHS[d.month - 1]}, {year_words(d.year)}",
    lambda d: f"{MONTHS[d.month - 1]} {ordinal_words(d.day)} {year_words(d.year)}",
)


def written_date(date: datetime.date, rng: random.Random) -> str:
    """`date` as one of the `TEMPLATES` drawn with `rng`.

    >>> written_date(datetime.date(1999, 5, 3), random.Random(0))
    'May 3rd 1999'
    """
    return rng.choice(TEMPLATES)(date)


def date_rows(count: int, split: str, seed: int = 0) -> list[dict]:
    """`count` rows `{"source": written date, "target": ISO date}` whose dates belong to `split` (distinct dates,
    drawn deterministically from `seed`; a `count` above the split's days gets each of them once).

    >>> date_rows(2, "test")
    [{'source': 'October 6, 1980', 'target': '1980-10-06'}, {'source': '24 December 2054', 'target': '2054-12-24'}]
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r} must be a non-negative int")
    rng = random.Random(f"dates|{seed}|{split}")
    order = list(range(DAYS))
    rng.shuffle(order)
    rows = []
    for offset in order:
        if len(rows) == count:
            break
        date = FIRST_DAY + datetime.timedelta(days=offset)
        if split_of_key(date.isoformat()) == split:
            rows.append({"source": written_date(date, rng), "target": date.isoformat()})
    return rows
