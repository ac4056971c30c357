"""Your own data for every stage: any `datasets` source read into the columns a stage's format names, renamed on
request, checked (a malformed json line named by its file and line), and split into train / dev / test by content
(`identity.carve`), with what identifies it (`data_identity`) for `run_info.json`."""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import re

from datasets import DatasetDict, Value, load_dataset

from .formats import BUILDERS, FORMAT_COLUMNS, STAND_INS, TEXT_COLUMNS
from .identity import HELD_OUT, carve, check_room, dataset_cache_dir, files_record, held_out_record
from .validation import check_dataset_name, open_text


logger = logging.getLogger(__name__)

# a label spelled as an integer (pandas reads `07`, `+7` and ` 7` as the integer 7)
INTEGER = re.compile(r"[+-]?[0-9]+")


def load_user_splits(
    data_format: str,
    dataset_name: str,
    dataset_config: str | None,
    data_files: list[str] | None,
    sizes: dict[str, int],
    seed: int,
    rename_columns: str | None = None,
    keep_duplicates: bool = False,
    data_cache_dir: str | None = None,
    carving: str = "content",
    held_out_fraction: float | None = None,
) -> DatasetDict:
    """Your data in `data_format` with `train`/`dev`/`test` splits (the arguments of `sources.load_stage_dataset`),
    carrying `.identity` (`data_identity`). `carving="position"` holds rows out as runs recorded before their
    held-out rows were named by content did (`position_carve`), so that `plugformer eval` scores what they held out.
    With `held_out_fraction`, the `dev`/`test` sizes are caps, each carved split taking at most that share of the
    distinct rows (`identity.held_out_sizes`); the sizes used are printed and recorded (`held_out_sizes`)."""
    check_dataset_name(dataset_name)  # before any file is read: an empty name read the current folder
    if data_files and dataset_name not in BUILDERS:
        raise ValueError(f"data_files={data_files} need dataset_name to be a builder (json, csv, text, parquet, arrow)")
    source = f"--dataset_name {dataset_name}" + (f" --data_files {' '.join(data_files)}" if data_files else "")
    files = files_record(dataset_name, data_files, data_cache_dir)  # before reading: a file named twice is refused
    # a CSV's labels as written (pandas read 07 and 7 as one integer), made integers again by `csv_labels`
    options = {"converters": {label_source(rename_columns): as_written}} if dataset_name == "csv" else {}
    loaded = load_user_dataset(dataset_name, dataset_config, data_files, source, dataset_cache_dir(files), **options)
    splits = DatasetDict({_canonical_split(name): split for name, split in loaded.items()})
    if "train" not in splits:
        raise ValueError(f"dataset {dataset_name!r} has no train split; it has {sorted(loaded)}")
    if rename_columns:
        splits = splits.rename_columns(column_renames(rename_columns, splits["train"].column_names, source))
    if options and "label" in splits["train"].column_names:
        splits = csv_labels(splits)
    columns = splits["train"].column_names
    missing = [c for c in FORMAT_COLUMNS[data_format] if c not in columns and STAND_INS.get(c) not in columns]
    if missing:
        named = [f"{c} (or {STAND_INS[c]})" if c in STAND_INS else c for c in missing]
        raise ValueError(f"{source}: lacks the columns {named} of the {data_format!r} format (it has {columns})")
    for column in TEXT_COLUMNS.get(data_format, ()):
        if column in columns:
            check_text_column(splits["train"], source, column)  # before carving: its row is the row of the files
    if carving == "position":
        return position_carve(splits, sizes, seed, source)
    carved = [name for name in HELD_OUT if name not in splits and sizes.get(name, 0) > 0]
    splits, keys, dropped = carve(splits, sizes, seed, keep_duplicates, source, held_out_fraction)
    splits.identity = data_identity(files, keys, dropped, keep_duplicates)
    if held_out_fraction is not None:
        splits.identity["held_out_sizes"] = used = held_out_used(keys, sizes, carved, held_out_fraction)
        announce_held_out(used, source)
    if dropped:
        logger.warning(
            "%s: dropped %s rows identical to a held-out row (--keep_duplicates true keeps them)",
            source,
            ", ".join(f"{count} {name}" for name, count in dropped.items()),
        )
    return splits


def position_carve(splits: DatasetDict, sizes: dict[str, int], seed: int, source: str) -> DatasetDict:
    """`test`, then `dev`, held out of `train` by `datasets`' seeded `train_test_split` (by position): how runs
    recorded before `identity.carve` split your data. Their rows cannot be verified by content."""
    for held_out in HELD_OUT:
        if held_out not in splits and sizes.get(held_out, 0) > 0:
            check_room(splits["train"], held_out, sizes[held_out], source)
            parts = splits["train"].train_test_split(test_size=sizes[held_out], seed=seed)
            splits["train"], splits[held_out] = parts["train"], parts["test"]
    return splits


def held_out_used(keys: dict[str, list[str]], caps: dict[str, int], carved: list[str], fraction: float) -> dict:
    """`run_info.json`'s record of the held-out sizes scaled to the data: the rows each carved split holds, the caps
    (`--test_examples`, `--dev_examples`), the share and the distinct rows it is a share of. A split the source
    holds itself is not carved and not listed."""
    distinct = len({key for name in ("train", *carved) for key in keys.get(name, [])})  # train's before carving
    return {
        **{name: len(keys.get(name, [])) for name in carved},
        "caps": {name: caps.get(name, 0) for name in HELD_OUT},
        "fraction": fraction,
        "distinct_rows": distinct,
    }


_ANNOUNCED: set[tuple] = set()  # a stage reads its data twice (training rows, dev problems): one line for both


def announce_held_out(used: dict, source: str) -> None:
    """Prints the held-out sizes a run uses, once per process and source (the main process only)."""
    sizes = tuple((name, used[name], used["caps"][name]) for name in HELD_OUT if name in used)
    if not sizes or (source, sizes) in _ANNOUNCED or int(os.environ.get("RANK", "0")) != 0:
        return
    _ANNOUNCED.add((source, sizes))
    parts = ", ".join(f"{rows} {name} (--{name}_examples {cap})" for name, rows, cap in sizes)
    print(
        f"[data] held out {parts} of {used['distinct_rows']} distinct rows, each at most "
        f"{used['fraction']:g} of them (--held_out_fraction)",
        flush=True,
    )


def data_identity(files: list, keys: dict[str, list[str]], dropped: dict[str, int], keep_duplicates: bool) -> dict:
    """What `run_info.json` records of a user's data beside its source: each file's sha256 (`identity.files_record`),
    the held-out splits' digests and row keys, and the rows dropped as twins of held-out rows."""
    return {
        "files": files,
        "held_out": held_out_record(keys),
        "duplicates_dropped": dropped,
        "keep_duplicates": keep_duplicates,
    }


def column_renames(text: str, columns: list[str], source: str = "your data") -> dict[str, str]:
    """`"document=source,summary=target"` as `{"document": "source", "summary": "target"}`, checked against the
    data's `columns`: each old name must be one of them, and no new name may be a column left as it is (two columns
    of one name).

    >>> column_renames("question=prompt, answer=answer", ["question", "answer", "id"])
    {'question': 'prompt'}
    """
    renames = {}
    for item in text.split(","):
        old, separator, new = (part.strip() for part in item.partition("="))
        if not item.strip():
            continue
        if not separator or not old or not new:
            raise ValueError(f"--rename_columns {text!r}: expected comma-separated OLD=NEW pairs, got {item.strip()!r}")
        if old not in columns:
            raise ValueError(f"--rename_columns {text!r}: {source} has no column {old!r}; its columns: {columns}")
        if old in renames:
            raise ValueError(f"--rename_columns {text!r}: {old!r} is renamed twice")
        if old != new:
            renames[old] = new
    kept = set(columns) - set(renames)
    clashes = sorted(new for new in renames.values() if new in kept)
    if clashes or len(set(renames.values())) < len(renames):
        twice = clashes or sorted({n for n in renames.values() if list(renames.values()).count(n) > 1})
        raise ValueError(
            f"--rename_columns {text!r}: {twice} would name two columns (the data has {columns}); "
            "rename or drop the other one too"
        )
    return renames


def load_user_dataset(
    dataset_name: str,
    dataset_config: str | None,
    data_files: list[str] | None,
    source: str,
    cache_dir: str | None = None,
    **options,
):
    """`datasets.load_dataset` (into `cache_dir`: `identity.dataset_cache_dir`; `options` for the builder), with a
    malformed line of a json file, or a row of a CSV file with more fields than its header, reported as its file and
    line number; any other file `datasets` cannot parse as the one line of its parser's error and the files."""
    from datasets.exceptions import DatasetGenerationError

    try:
        return load_dataset(dataset_name, dataset_config, data_files=data_files, cache_dir=cache_dir, **options)
    except DatasetGenerationError as error:
        find = {"json": first_malformed_json_line, "csv": first_malformed_csv_row}.get(dataset_name)
        where = find(data_files) if find is not None and data_files else None
        cause = error.__cause__
        if where is None and isinstance(cause, ValueError):  # pandas' ParserError, pyarrow's ArrowInvalid, json's
            where = f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}"
        if where is None:
            raise
        raise ValueError(f"{source}: {where}") from error


def label_source(rename_columns: str | None) -> str:
    """The column of the files that becomes `label` (`--rename_columns "sentiment=label"`: `sentiment`).

    >>> label_source(None), label_source("review=text, stars = label")
    ('label', 'stars')
    """
    for item in (rename_columns or "").split(","):
        old, _, new = (part.strip() for part in item.partition("="))
        if new == "label" and old:
            return old
    return "label"


def as_written(value: str) -> str:
    """pandas' converter for a CSV column kept as its text (`07` stays `07`); missing values stay missing."""
    return value


def csv_labels(splits: DatasetDict) -> DatasetDict:
    """A CSV's `label` column, read as written (`as_written`), back as integers where pandas would have read integers
    and no two spellings name one integer: `07` and `7` stay two classes (`"07"`, `"7"`), `0`/`1` are integers as
    before (and ` 1`, with the space pandas ignores, is `1`)."""
    spellings = {value.strip() for split in splits.values() for value in split["label"] if isinstance(value, str)}
    if not spellings or not all(INTEGER.fullmatch(value) for value in spellings):
        return splits
    if len({int(value) for value in spellings}) < len(spellings):
        return splits  # two spellings of one number: every label kept as written

    def integer(row: dict) -> dict:
        return {"label": None if row["label"] is None else int(row["label"])}

    converted = {}
    for name, split in splits.items():
        features = split.features.copy()
        features["label"] = Value("int64")
        converted[name] = split.map(integer, features=features)
    return DatasetDict(converted)


def check_text_column(train, source: str, column: str = "text") -> None:
    """Raises `ValueError` naming the row (counted from 0 across the files, in order) of the first value of `column`
    that is not a string; `datasets` loads a column of mixed types as JSON values, and pandas a CSV column of numbers
    as numbers, which tokenisation cannot read (`TypeError: TextInputSequence must be str`)."""
    if train.features[column] == Value("string") or train.features[column] == Value("large_string"):
        return
    for start in range(0, len(train), 1000):
        for offset, value in enumerate(train[start : start + 1000][column]):
            if not isinstance(value, str) and value is not None:  # nulls are named by `check_rows`
                raise ValueError(
                    f"{source}: column {column!r} holds a {type(value).__name__} ({value!r:.40}) in row "
                    f"{start + offset} (counted from 0 across the files); every value must be text"
                )


def _canonical_split(name: str) -> str:
    return {"validation": "dev", "valid": "dev", "eval": "dev"}.get(name, name)


def first_malformed_csv_row(data_files: list[str]) -> str | None:
    """`"<file> line <n>: ..."` for the first row of the CSV `data_files` with more fields than the file's header
    (pandas refuses those; fewer are read as missing values), or `None`. Read only after `datasets` failed."""
    for name in data_files:
        for path in sorted(glob.glob(name)) or [name]:
            with open_text(path) as file:
                reader = csv.reader(file)
                header = next(reader, [])
                for row in reader:
                    if len(row) > len(header):
                        return (
                            f"{path} line {reader.line_num}: {len(row)} fields where its header has "
                            f"{len(header)} ({', '.join(header)[:80]}); quote a field that holds a comma"
                        )
    return None


def first_malformed_json_line(data_files: list[str]) -> str | None:
    """`"<file> line <n>: <error>"` for the first line of the json-lines `data_files` that is not JSON, or `None`.
    Read only after `datasets` failed, so a good corpus is never parsed twice."""
    for name in data_files:
        for path in sorted(glob.glob(name)) or [name]:
            with open_text(path) as file:
                if file.read(4096).lstrip().startswith("["):
                    continue  # one JSON array over many lines, not JSON lines
                file.seek(0)
                for number, line in enumerate(file, start=1):
                    if not line.strip():
                        continue
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as error:
                        return f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno})"
    return None
