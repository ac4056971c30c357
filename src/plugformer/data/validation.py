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

from .formats import BUILDERS, FORMAT_COLUMNS


TEXT_BUILDERS = ("json", "csv", "text")  # builders that read text files (parquet and arrow are binary)
# the files each builder reads, for a folder given as --data_files (`datasets`' own extensions)
BUILDER_EXTENSIONS = {"json": (".jsonl", ".json"), "csv": (".csv",), "text": (".txt",), "parquet": (".parquet",),
                      "arrow": (".arrow",)}  # fmt: skip
# compressed files `datasets` reads as the file inside (it recognises them by these first bytes): name -> (magic,
# the module that opens it); zstd needs the `zstandard` package, as `datasets` does
COMPRESSIONS = {"gzip": (b"\x1f\x8b", "gzip"), "bz2": (b"BZh", "bz2"), "xz": (b"\xfd7zXZ\x00", "lzma"),
                "zstd": (b"\x28\xb5\x2f\xfd", "zstandard")}  # fmt: skip
# data formats whose data may come in one of several column sets: those TRL's SFTTrainer accepts
FORMAT_ALTERNATIVES = {"conversation": (("text",), ("messages",), ("prompt", "completion"))}
# columns a format does without, but once present every row needs a value: classify's text_pair (a pair in some rows
# and a single text in others reached the tokenizer as `TypeError: TextInputSequence must be str`)
ALL_OR_NONE = {"classification": ("text_pair",)}


def check_dataset_name(dataset_name: str) -> None:
    """Raises `ValueError` for a `--dataset_name` that can name nothing: empty (read as the current folder, whose
    every file was digested as data), a local path that does not exist (`datasets`' `FileNotFoundError` named no
    option), a file (`datasets` takes files as `--data_files`) or a folder without files."""
    from ..runtime.files import looks_local

    if not str(dataset_name).strip():
        raise ValueError(
            f"--dataset_name {dataset_name!r}: expected a builder ({', '.join(BUILDERS)}) with "
            "--data_files, a local folder, or a Hub id"
        )
    if dataset_name in BUILDERS:
        return
    path = Path(dataset_name).expanduser()
    if looks_local(dataset_name) and not path.exists():
        raise ValueError(
            f"--dataset_name {dataset_name}: no such folder or file; give a folder of data files, or a "
            f"builder ({', '.join(BUILDERS)}) with --data_files"
        )
    if path.is_file():  # `datasets` reads a folder or a Hub id here: "Couldn't find any data file", naming no option
        builder = next((name for name, ends in BUILDER_EXTENSIONS.items() if path.name.endswith(ends)), "json")
        raise ValueError(
            f"--dataset_name {dataset_name} is a file; give it as --dataset_name {builder} --data_files "
            f"{dataset_name} (or its folder as --dataset_name)"
        )
    if path.is_dir() and not any(item.is_file() for item in path.rglob("*")):
        raise ValueError(f"--dataset_name {dataset_name}: the folder holds no files; give a folder of data files")


def refuse_source_options_without_a_source(dataset_name: str | None, **options) -> None:
    """Raises `ValueError` naming the first of `options` (`data_files=[...]`, `dataset_config=...`, given by their
    field names) that is set while `dataset_name` is not: alone it describes no source, and the command would read
    the embedded data, the option unread (`--data_files corpus.jsonl` alone trained on arithmetic)."""
    if dataset_name is not None:
        return
    for name, value in options.items():
        if value:
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            raise ValueError(
                f"--{name} {shown} describes your data, but --dataset_name is not given, so the embedded "
                "data would be read instead: add --dataset_name (json, csv, text or parquet with "
                "--data_files; a folder; a Hub id when online)"
            )


def folder_given_as_file(name: str, dataset_name: str | None) -> str:
    """The message for a folder given as `--data_files`: how to name its files (a pattern of the extension its files
    have, else the builder's) or the folder itself (`--dataset_name`)."""
    extensions = BUILDER_EXTENSIONS.get(dataset_name or "", ())
    found = sorted({"".join(p.suffixes[-2:]) for p in Path(name).iterdir() if p.is_file() and p.suffix})
    suffix = next((s for s in found if s.startswith(extensions)), None) or (extensions or found or ("",))[0]
    pattern = str(Path(name) / f"*{suffix}")
    return (
        f"--data_files {name} is a folder, and --data_files names files; give its files as a pattern "
        f"(--data_files '{pattern}') or the folder as --dataset_name {name} (without --data_files)"
    )


def check_data_files(dataset_name: str | None, data_files: list[str] | None) -> None:
    """Raises `ValueError` naming the file if one of `data_files` (paths or glob patterns) is missing, a folder,
    empty or, for a text builder (`json`, `csv`, `text`), not UTF-8 (a compressed file `datasets` reads, `a.jsonl.gz`,
    is checked inside: `COMPRESSIONS`)."""
    for pattern in data_files or []:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise ValueError(f"--data_files {pattern}: the pattern matches no file")
        for name in matches:
            path = Path(name)
            if path.is_dir():
                raise ValueError(folder_given_as_file(name, dataset_name))
            if not path.is_file():
                raise ValueError(f"--data_files {name}: no such file")
            if dataset_name in TEXT_BUILDERS:
                _check_text_file(path)
            elif path.stat().st_size == 0:
                raise ValueError(f"--data_files {name}: the file is empty")


def compression(path: str | Path) -> str | None:
    """The `COMPRESSIONS` name of the file at `path`, by its first bytes, or None."""
    with open(path, "rb") as handle:
        start = handle.read(8)
    return next((name for name, (magic, _) in COMPRESSIONS.items() if start.startswith(magic)), None)


def open_binary(path: str | Path):
    """`path` opened for reading bytes, decompressed when `datasets` would decompress it (`compression`); `None` for
    a compression whose module is not installed (`datasets` cannot read it either)."""
    import importlib

    kind = compression(path)
    if kind is None:
        return open(path, "rb")
    try:
        module = importlib.import_module(COMPRESSIONS[kind][1])
    except ImportError:
        return None
    if kind == "zstd":
        return module.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return module.open(path, "rb")


def open_text(path: str | Path):
    """`path` as UTF-8 text (undecodable bytes replaced), decompressed as `open_binary` reads it."""
    import io

    handle = open_binary(path)
    return (
        open(path, encoding="utf-8", errors="replace")
        if handle is None
        else io.TextIOWrapper(handle, encoding="utf-8", errors="replace", newline=None)
    )


def _check_text_file(path: Path) -> None:
    handle = open_binary(path)
    if handle is None:  # compressed by a module this environment lacks: `datasets` says so itself
        return
    inside = " (decompressed)" if compression(path) else ""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, content = 0, False
    with handle:
        for block in iter(lambda: _read(handle, path), b""):
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"--data_files {path}: not UTF-8 text (byte {offset + error.start}{inside} is "
                    f"{block[error.start : error.start + 1]!r}); re-encode it as UTF-8"
                ) from None
            content = content or bool(text.strip())
            offset += len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"--data_files {path}: not UTF-8 text (it ends inside a character)") from None
    if not content:
        raise ValueError(f"--data_files {path}: the file is empty (no rows{inside})")


def _read(handle, path: Path) -> bytes:
    """The next MiB of `handle`; a compressed file that is damaged (cut short, bad data) is named."""
    try:
        return handle.read(1 << 20)
    except (OSError, EOFError, ValueError) as error:  # gzip.BadGzipFile, EOFError, lzma.LZMAError, zstd's
        raise ValueError(
            f"--data_files {path}: a damaged {compression(path)} file ({type(error).__name__}: "
            f"{error}); compress it again"
        ) from None


def required_columns(data_format: str, columns: list[str], source: str, reader: str) -> tuple[str, ...]:
    """The columns of `data_format` that must hold a value in every row (with those of `ALL_OR_NONE` it has); for a
    format with alternatives (TRL's SFT column sets) the first one present, refused (`ValueError` naming what
    `reader` needs) when none is."""
    if data_format not in FORMAT_ALTERNATIVES:
        return tuple(
            c for c in (*FORMAT_COLUMNS.get(data_format, ()), *ALL_OR_NONE.get(data_format, ())) if c in columns
        )
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
                raise ValueError(
                    f"{source}: column {column!r} is null in row {row} of the {split_name} split "
                    f"({reader} needs a value in every row)"
                )


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
        raise ValueError(
            f"--dataset_name {dataset_name!r}: no local folder or file of that name, and the Hugging "
            "Face Hub is offline (plugformer sets HF_HUB_OFFLINE=1 unless you set it); run with "
            "HF_HUB_OFFLINE=0 to load it from the Hub, or give a local folder, or --dataset_name json "
            "--data_files FILE.jsonl"
        ) from error
