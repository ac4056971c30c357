"""Checks of user data before any training: each problem named with its file (or split), column and row.

Without them an empty jsonl ended in `StopIteration`, a Latin-1 file in a `UnicodeDecodeError` without its name, a
null `text` deep inside tokenisation, and SFT data with other columns in `KeyError: 'text'`.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
from collections.abc import Iterator
from pathlib import Path


TEXT_BUILDERS = ("json", "csv", "text")  # builders that read text files (parquet and arrow are binary)
# data formats whose data may come in one of several column sets: those TRL's SFTTrainer accepts
FORMAT_ALTERNATIVES = {"conversation": (("text",), ("messages",), ("prompt", "completion"))}


def check_data_files(dataset_name: str | None, data_files: list[str] | None) -> None:
    """Raises `ValueError` naming the file if one of `data_files` (paths or glob patterns) is missing, empty or, for
    a text builder (`json`, `csv`, `text`), not UTF-8."""
    for pattern in data_files or []:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise ValueError(f"--data_files {pattern}: the pattern matches no file")
        for name in matches:
            path = Path(name)
            if not path.is_file():
                raise ValueError(f"--data_files {name}: no such file")
            if dataset_name in TEXT_BUILDERS:
                _check_text_file(path)
            elif path.stat().st_size == 0:
                raise ValueError(f"--data_files {name}: the file is empty")


def _check_text_file(path: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, content = 0, False
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as error:
                raise ValueError(f"--data_files {path}: not UTF-8 text (byte {offset + error.start} is "
                                 f"{block[error.start : error.start + 1]!r}); re-encode it as UTF-8") from None  # fmt: skip
            content = content or bool(text.strip())
            offset += len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"--data_files {path}: not UTF-8 text (it ends inside a character)") from None
    if not content:
        raise ValueError(f"--data_files {path}: the file is empty (no rows)")


def required_columns(data_format: str, columns: list[str], source: str, reader: str) -> tuple[str, ...]:
    """The columns of `data_format` that must hold a value in every row; for a format with alternatives (TRL's SFT
    column sets) the first one present, refused (`ValueError` naming what `reader` needs) when none is."""
    from .user_data import FORMAT_COLUMNS

    if data_format not in FORMAT_ALTERNATIVES:
        return tuple(c for c in FORMAT_COLUMNS.get(data_format, ()) if c in columns)
    for format_columns in FORMAT_ALTERNATIVES[data_format]:
        if all(c in columns for c in format_columns):
            return format_columns
    needed = " | ".join("+".join(format_columns) for format_columns in FORMAT_ALTERNATIVES[data_format])
    raise ValueError(f"{source}: {reader} needs the columns {needed} (TRL's formats); it has {columns}")


def check_rows(data_format: str, data, source: str, reader: str) -> None:
    """Raises `ValueError` naming the split, column and row where a required column of `data_format` is null
    (`None`), or where a split has no rows; `reader` (e.g. "stage 'sft'") is named as what needs the value."""
    for split_name, split in data.items():
        if len(split) == 0:
            raise ValueError(f"{source}: the {split_name} split has no rows")
        for column in required_columns(data_format, split.column_names, source, reader):
            if split.data.column(column).null_count == 0:
                continue  # Arrow counts nulls without reading the values: a large corpus is checked at once
            row = next((i for i, value in enumerate(split[column]) if value is None), None)
            if row is not None:
                raise ValueError(f"{source}: column {column!r} is null in row {row} of the {split_name} split "
                                 f"({reader} needs a value in every row)")  # fmt: skip


def hub_offline() -> bool:
    """Whether `datasets` and huggingface_hub run offline (`HF_HUB_OFFLINE`, which plugformer sets to 1 unless the user
    set it: `runtime.offline`)."""
    from datasets import config
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE or config.HF_HUB_OFFLINE)


@contextlib.contextmanager
def refusing_hub_ids_offline(dataset_name: str | None) -> Iterator[None]:
    """Turns the `ConnectionError` that `datasets.load_dataset` raises offline for a name that is no local folder or
    builder (a Hub id, or a misspelt path), a 41-line traceback without a hint, into one `ValueError` naming
    `dataset_name` and the switch that turns the Hub on. Online, a `ConnectionError` is a real one and passes."""
    try:
        yield
    except ConnectionError as error:
        if not hub_offline():
            raise
        raise ValueError(f"--dataset_name {dataset_name!r}: no local folder or file of that name, and the Hugging "
                         "Face Hub is offline (plugformer sets HF_HUB_OFFLINE=1 unless you set it); run with "
                         "HF_HUB_OFFLINE=0 to load it from the Hub, or give a local folder, or --dataset_name json "
                         "--data_files FILE.jsonl") from error  # fmt: skip
