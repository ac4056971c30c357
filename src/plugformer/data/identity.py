"""What the data a result rests on is: each local file by the sha256 of its bytes, each row by the sha256 of what a
stage reads of it, each held-out split by the digest of its rows.

A path, a size and a modification time do not name content: `cp -p` or `rsync -t` of an edited copy keeps all three,
and `datasets` keys its own Arrow cache on the modification time alone. So:

- `files_record` digests every file a source reads (globs and links resolved; the same file, or two files of the
  same bytes, twice is refused). A digest is computed once and kept in the cache (`digests/`) with the file's device,
  inode, size, modification and change times: the change time moves on every write and cannot be set back by a
  user, so an unchanged file is not read again, and an edited one always is.
- `dataset_cache_dir` gives `datasets` a cache folder per content, so its Arrow copy can never be of older bytes.
- `carve` holds out `dev` and `test` rows by rank of a seeded digest of each row's content, not by position: rows
  added to a file never move a row that trained into a held-out split, and a row's split does not depend on the
  order of the files. Rows of train identical to a held-out row are dropped (counted) unless `keep_duplicates`.
- `held_out_record` (in `run_info.json`) keeps each held-out split's digest and its rows' keys, so that
  `plugformer eval` scores the rows the run held out, found by content in the data as it is now, or refuses.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
from pathlib import Path

from datasets import Dataset, DatasetDict

from .validation import check_dataset_name, folder_given_as_file


logger = logging.getLogger(__name__)

# the columns a stage reads (TRL's formats and plugformer's own): a row is keyed by those it has, so that an id
# column or a timestamp does not make a copied document look new
CONTENT_COLUMNS = ("text", "text_pair", "prompt", "completion", "messages", "chosen", "rejected", "answer",
                   "solution", "label", "source", "target")  # fmt: skip
KEY_HEX = 16  # a row key's hex digits kept in run_info.json: 64 bits, no collision among billions of rows
HELD_OUT = ("test", "dev")  # carved in this order: test first, as ranked
# the most of your data's distinct rows each carved held-out split takes (`--held_out_fraction`): 300 chats with
# the shipped caps of 200 hold out 30 + 30 rows instead of refusing
HELD_OUT_FRACTION = 0.1


def local_files(dataset_name: str | None, data_files: list[str] | None) -> list[Path]:
    """The files a source reads, resolved (globs expanded in sorted order, links followed): `data_files`, else the
    files of a local folder given as `dataset_name` (hidden ones skipped, as `datasets` does); none for a Hub id.

    Raises `ValueError` when one file is named twice (the same path, a link to it, overlapping globs): it would be
    trained twice and its held-out rows would have their twins in train."""
    if dataset_name is not None:
        check_dataset_name(dataset_name)  # an empty name is the current folder: every file in it digested as data
    if data_files:
        named = [
            (pattern, Path(path).resolve())
            for pattern in data_files
            for path in (sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern])
        ]
    elif dataset_name is not None and Path(dataset_name).is_dir():
        folder = Path(dataset_name)
        named = [
            (dataset_name, path.resolve())
            for path in sorted(folder.rglob("*"))
            if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts)
        ]
    else:
        return []
    unmatched = [pattern for pattern in data_files or [] if glob.has_magic(pattern) and not glob.glob(pattern)]
    if unmatched:
        raise ValueError(f"--data_files {unmatched[0]}: the pattern matches no file")
    seen: dict[Path, str] = {}
    for pattern, path in named:
        if path.is_dir() and data_files:
            raise ValueError(folder_given_as_file(str(path) if glob.has_magic(pattern) else pattern, dataset_name))
        if not path.is_file():
            raise ValueError(f"--data_files {pattern}: no such file" + (f" ({path})" if str(path) != pattern else ""))
        if path in seen:
            same = "is named twice" if pattern == seen[path] else f"is named by both {seen[path]} and {pattern}"
            raise ValueError(
                f"--data_files: {path} {same}; every document would train twice and each held-out "
                "row would have its twin in train. Name each file once"
            )
        seen[path] = pattern
    return list(seen)


def file_sha256(path: Path, cache: Path | None = None) -> str:
    """The sha256 of `path`'s bytes, read from `cache` when the file's identity and times are those it was digested
    with (device, inode, size, modification and change time in ns), else computed and kept there."""
    stat = path.stat()
    signature = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
    entry = cache / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json" if cache is not None else None
    if entry is not None:
        try:
            kept = json.loads(entry.read_text())
            if kept.get("path") == str(path) and kept.get("signature") == signature:
                return kept["sha256"]
        except (OSError, ValueError, AttributeError):
            pass
    with open(path, "rb") as handle:
        value = hashlib.file_digest(handle, "sha256").hexdigest()
    if entry is not None:
        _keep(entry, {"path": str(path), "signature": signature, "sha256": value})
    return value


def _keep(entry: Path, record: dict) -> None:
    """Writes a digest cache entry; a cache that cannot be written (read-only, a file in the way) only costs a
    re-read next time."""
    from ..runtime.files import write_json_atomic

    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(entry, record)
    except OSError as error:
        logger.debug("digest cache %s not written: %s", entry, error)


CACHE_VARIABLE = "PLUGFORMER_CACHE"  # the corpus cache's folder when --data_cache_dir is not given


def cache_location(data_cache_dir: str | None = None) -> tuple[Path, str]:
    """(`data_cache_dir`, else `$PLUGFORMER_CACHE` (an empty value counts as unset), else `~/.cache/plugformer`; how
    the user named it, for a message)."""
    if data_cache_dir:
        return Path(data_cache_dir).expanduser(), f"--data_cache_dir {data_cache_dir}"
    if os.environ.get(CACHE_VARIABLE, "").strip():
        return Path(os.environ[CACHE_VARIABLE]).expanduser(), f"{CACHE_VARIABLE}={os.environ[CACHE_VARIABLE]}"
    root = Path.home() / ".cache" / "plugformer"
    return root, f"the corpus cache {root} (--data_cache_dir or {CACHE_VARIABLE} moves it)"


def cache_root(data_cache_dir: str | None = None) -> Path:
    """`data_cache_dir`, else `$PLUGFORMER_CACHE`, else `~/.cache/plugformer` (`cache_location`). What is only an
    optimisation there (the files' digests) is skipped when it cannot be written; where a prepared corpus must be
    kept, `corpus_cache_root` refuses a path that cannot be a folder."""
    return cache_location(data_cache_dir)[0]


def corpus_cache_root(data_cache_dir: str | None = None) -> Path:
    """`cache_root`, or `ValueError` naming the option or the variable when that path is a file or lies under one: a
    pretraining corpus is prepared there (tokenizer, packed blocks), and the first entry failed with a
    `NotADirectoryError` traceback after the corpus was loaded. A folder that cannot be written is refused only
    where a new entry must be written (`prepare.publish`)."""
    from ..runtime.files import folder_problem

    root, named = cache_location(data_cache_dir)
    problem = folder_problem(root)
    if problem is not None:
        raise ValueError(f"{named}: {problem}; the corpus cache must be a folder (it is made if missing)")
    return root


def digest_cache(data_cache_dir: str | None = None) -> Path:
    """Where files' digests are kept: `digests/` of the corpus cache (`cache_root`)."""
    return cache_root(data_cache_dir) / "digests"


def files_record(dataset_name: str | None, data_files: list[str] | None, data_cache_dir: str | None = None) -> list:
    """`[{"path", "bytes", "sha256"}]` of every file the source reads (`local_files`). Two files of the same bytes
    are refused (`ValueError` naming both) for the reason `local_files` refuses one file twice."""
    cache = digest_cache(data_cache_dir)
    records, by_digest = [], {}
    for path in local_files(dataset_name, data_files):
        sha = file_sha256(path, cache)
        if sha in by_digest:
            raise ValueError(
                f"--data_files: {path} and {by_digest[sha]} hold the same bytes (sha256 {sha[:12]}); "
                "every document would train twice and each held-out row would have its twin in train. "
                "Keep one of them"
            )
        by_digest[sha] = path
        records.append({"path": str(path), "bytes": path.stat().st_size, "sha256": sha})
    return records


def files_digest(records: list) -> str | None:
    """One digest of a source's files (`files_record`), or None when it reads no local file."""
    if not records:
        return None
    return hashlib.sha256(json.dumps([[r["path"], r["sha256"]] for r in records]).encode()).hexdigest()


def dataset_cache_dir(records: list) -> str | None:
    """A `datasets` cache folder for exactly these bytes (`load_dataset(cache_dir=...)`): `datasets` keys its Arrow
    copy of a local file on the file's modification time, so an edit that keeps it would be served stale."""
    if not records:
        return None
    from datasets import config

    return str(Path(config.HF_DATASETS_CACHE) / "by-content" / files_digest(records)[:20])


def key_columns(columns: list[str]) -> list[str]:
    """The columns a row is keyed by: those a stage reads (`CONTENT_COLUMNS`), else all."""
    return [c for c in columns if c in CONTENT_COLUMNS] or list(columns)


def row_keys(split: Dataset, batch_size: int = 1000) -> list[str]:
    """The sha256 (hex) of each row's content (`key_columns`, as canonical JSON; a lone `text` as its UTF-8)."""
    columns = key_columns(split.column_names)
    keys = []
    for batch in split.select_columns(columns).iter(batch_size=batch_size):
        if columns == ["text"]:
            values = (str(text).encode("utf-8", "surrogatepass") for text in batch["text"])
        else:
            rows = zip(*(batch[c] for c in columns), strict=True)
            values = (
                json.dumps(
                    dict(zip(columns, row, strict=True)), sort_keys=True, ensure_ascii=False, default=str
                ).encode("utf-8", "surrogatepass")
                for row in rows
            )
        keys += [hashlib.sha256(value).hexdigest() for value in values]
    return keys


def split_digest(keys: list[str]) -> str:
    """The digest of a split's rows, in order: equal digests, the same rows."""
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def carve(
    splits: DatasetDict,
    sizes: dict[str, int],
    seed: int,
    keep_duplicates: bool = False,
    source: str = "your data",
    fraction: float | None = None,
):
    """`splits` with `test` and then `dev` (when missing and `sizes` asks for them) held out of `train` by rank of
    sha256(seed, row key), and, unless `keep_duplicates`, the rows of train (and of dev) identical to a row held out
    after them dropped. With `fraction`, `sizes` are caps scaled to the data (`held_out_sizes`). Returns (splits,
    keys per split, dropped rows per split)."""
    keys = {name: row_keys(split) for name, split in splits.items()}
    if fraction is not None:
        distinct = len(set(keys["train"]))
        scaled = held_out_sizes(distinct, sizes, fraction)
        for held_out in HELD_OUT:
            if held_out not in splits and sizes.get(held_out, 0) > 0 and scaled[held_out] == 0:
                refuse_too_few(splits["train"], distinct, held_out, sizes[held_out], fraction, source)
        sizes = {**sizes, **scaled}
    for held_out in HELD_OUT:
        wanted = sizes.get(held_out, 0)
        if held_out in splits or wanted <= 0:
            continue
        check_room(splits["train"], held_out, wanted, source)
        taken = {key for name in HELD_OUT for key in keys.get(name, [])}  # a twin of a test row is no dev row
        chosen = ranked_distinct(keys["train"], seed, wanted, taken)
        splits[held_out], keys[held_out] = splits["train"].select(chosen), [keys["train"][i] for i in chosen]
        chosen = set(chosen)
        _keep_rows(splits, keys, "train", [i for i in range(len(keys["train"])) if i not in chosen])
    dropped = {}
    for name, later in (("train", ("dev", "test")), ("dev", ("test",))):
        held = {key for other in later for key in keys.get(other, [])}
        twins = sum(key in held for key in keys.get(name, []))
        if twins and not keep_duplicates:
            _keep_rows(splits, keys, name, [i for i, key in enumerate(keys[name]) if key not in held])
            dropped[name] = twins
    return splits, keys, dropped


def check_room(train: Dataset, held_out: str, wanted: int, source: str) -> None:
    """Raises `ValueError` unless `train` keeps rows after holding `wanted` out as `held_out`."""
    if len(train) <= wanted:
        raise ValueError(
            f"{source}: {len(train)} rows left in train cannot give --{held_out}_examples {wanted} and "
            "still train; hold out fewer"
        )


def held_out_sizes(distinct: int, caps: dict[str, int], fraction: float) -> dict[str, int]:
    """Each held-out split's size for data of `distinct` rows: its cap (`--test_examples`, `--dev_examples`), but at
    most `fraction` of the rows (rounded down: at least 1 from 1 / `fraction` rows on).

    >>> held_out_sizes(300, {"test": 200, "dev": 200}, 0.1)
    {'test': 30, 'dev': 30}
    >>> held_out_sizes(5000, {"test": 200, "dev": 0}, 0.1)
    {'test': 200, 'dev': 0}
    """
    share = math.floor(distinct * fraction + 1e-9)  # 1e-9: 0.29 * 100 is 28.999999999999996
    return {name: min(caps.get(name, 0), share) for name in HELD_OUT}


def refuse_too_few(train: Dataset, distinct: int, held_out: str, cap: int, fraction: float, source: str) -> None:
    """Raises `ValueError` for data too small to hold out even `fraction` of its rows as `held_out`."""
    needed = math.ceil(1 / fraction - 1e-9)
    raise ValueError(
        f"{source}: {len(train)} rows left in train cannot give --{held_out}_examples {cap} and still "
        f"train, and {fraction:g} of its {distinct} distinct rows (--held_out_fraction) is not one row: "
        f"give at least {needed} distinct rows, or --{held_out}_examples 0"
    )


def _keep_rows(splits: DatasetDict, keys: dict[str, list[str]], name: str, indices: list[int]) -> None:
    """Keeps the rows `indices` of split `name`, and their keys."""
    splits[name], keys[name] = splits[name].select(indices), [keys[name][i] for i in indices]


def ranked_distinct(keys: list[str], seed: int, count: int, taken: set[str] = frozenset()) -> list[int]:
    """The indices of the first `count` rows of distinct content, none of them `taken`, in the order of sha256(seed,
    key): a row's rank depends on its content and the seed alone. A copy of a chosen or taken row is not chosen (it
    stays behind, to be dropped as a twin)."""
    ranked = sorted(range(len(keys)), key=lambda i: hashlib.sha256(f"{seed}|{keys[i]}".encode()).digest())
    chosen, seen = [], set(taken)
    for index in ranked:
        if keys[index] not in seen:
            seen.add(keys[index])
            chosen.append(index)
            if len(chosen) == count:
                break
    return chosen


def held_out_record(keys: dict[str, list[str]]) -> dict:
    """`run_info.json`'s record of the held-out splits: each one's row count, digest and rows' keys (`KEY_HEX`)."""
    return {
        name: {
            "rows": len(keys[name]),
            "sha256": split_digest(keys[name]),
            "row_keys": [key[:KEY_HEX] for key in keys[name]],
        }
        for name in HELD_OUT
        if name in keys
    }
