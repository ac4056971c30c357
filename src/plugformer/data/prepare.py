"""A pretraining corpus prepared once: the tokenizer trained on a bounded sample, the documents tokenized and packed
on every core into Arrow blocks on disk, reused by every later run, every run of a `compare` grid and every rank.

Layout of the cache (`--data_cache_dir`, default `$PLUGFORMER_CACHE` or `~/.cache/plugformer`):

    tokenizers/<key>/   the tokenizer trained for (corpus, vocab_size, sample size, seed)
    blocks/<key>/       the packed splits' Arrow files, as the workers wrote them, for (corpus, tokenizer,
                        block_size, document positions, causal labels, packing version)

A key is a digest of what the content depends on; the corpus part digests each data file's path and the sha256 of its
bytes (`identity.files_record`, kept in `digests/` so that an unchanged file is not read twice) and the loaded splits'
`datasets` fingerprints, so a changed corpus or tokenizer never reuses stale blocks. A folder appears only complete (written beside it, then renamed), so an interrupted preparation is redone,
never read half-written; a published blocks folder found damaged later (a shard cut short: `load_blocks`) is
moved aside and prepared again. Deleting the cache folder is always safe: it is rebuilt on the next run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import (
    Dataset,
    DatasetDict,
    Features,
    IterableDataset,
    List,
    Value,
    concatenate_datasets,
    load_dataset,
)

from ..runtime.files import writable_folder_problem, write_json_atomic
from .identity import CACHE_VARIABLE, files_record
from .packing import pack


def say(message: str, *args) -> None:
    """A phase of the preparation on the terminal, as `[corpus] ...` (a long corpus must never look stuck)."""
    print("[corpus] " + message % args, flush=True)


# bump when `pack` changes what it writes: blocks prepared by an older version are then prepared again
PACKING_VERSION = 2


def digest(*parts) -> str:
    """A short hex digest of JSON-serialisable `parts`."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def file_signatures(data_files: list[str] | None, data_cache_dir: str | None = None) -> list[list]:
    """(resolved path, sha256 of its bytes) of each local file `data_files` names, globs expanded
    (`identity.files_record`): changes whenever a file's content changes, or a file is added or removed."""
    return [[record["path"], record["sha256"]] for record in files_record(None, data_files, data_cache_dir)]


def corpus_fingerprint(source: dict, splits: DatasetDict, data_cache_dir: str | None = None) -> str:
    """The identity of a loaded corpus: its source (name, config, files with the sha256 of their bytes, split sizes
    and seed) and each split's `datasets` fingerprint."""
    files = file_signatures(source.get("data_files"), data_cache_dir)
    return digest(source, files, {name: split._fingerprint for name, split in splits.items()})


def tokenizer_fingerprint(tokenizer) -> str:
    """The identity of a tokenizer: its whole backend (vocabulary, merges, normalisation) and special tokens."""
    return digest(tokenizer.backend_tokenizer.to_str(), tokenizer.special_tokens_map)


def publish(build, target: Path) -> Path:
    """Runs `build(tmp_dir)` into a folder beside `target`, then renames it to `target` (atomic on one file system);
    if another process published `target` meanwhile, keeps theirs. A cache folder this process cannot write is
    refused (`ValueError` naming it) before `build` runs: no tokenizer is trained, no corpus packed, for nothing."""
    problem = writable_folder_problem(target.parent)
    if problem is not None:
        raise ValueError(
            f"the corpus cache has no {target.parent.name} entry {target.name} for this corpus and "
            f"cannot take one: {problem}; give a folder you can write as --data_cache_dir (or "
            f"{CACHE_VARIABLE}), or make this one writable"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.partial"
    try:
        build(partial)
        try:
            os.rename(partial, target)
        except OSError:
            if (target / "complete").exists():
                return target  # another process published it first: theirs is kept
            shutil.rmtree(target)  # a folder without its marker was not written by `publish`: not trusted
            os.rename(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


@dataclass
class Corpus:
    """A pretraining corpus: its splits, and what identifies it in the cache.

    Args:
        splits (`DatasetDict`): Map-style splits with a `text` column: `train`, `dev`, `test`; with a `stream`, only
            the held-out `dev` and `test`.
        fingerprint (`str`, *optional*): The cache key of its content; `None` for data regenerated in seconds (the
            embedded generator), which is not cached.
        stream (`IterableDataset`, *optional*): The training documents read lazily (`--streaming`).
    """

    splits: DatasetDict
    fingerprint: str | None = None
    stream: IterableDataset | None = None

    def sample(self, max_bytes: int, seed: int) -> Iterator[str]:
        """Training texts up to `max_bytes` of UTF-8: a seeded random sample of the map-style train split, or the
        stream's first documents. Only one batch of texts is held at a time."""
        if self.stream is None:
            batches = random_batches(self.splits["train"], seed)
        else:
            batches = ([row["text"]] for row in self.stream)
        taken, documents = 0, 0
        for batch in batches:
            for text in batch:
                yield text
                documents += 1
                taken += len(text.encode("utf-8", "surrogatepass"))
                if taken >= max_bytes:
                    say("tokenizer sample: %d documents, %.1f MB", documents, taken / 1e6)
                    return
        say("tokenizer sample: the whole training split, %d documents, %.1f MB", documents, taken / 1e6)


def random_batches(train: Dataset, seed: int, batch: int = 1000) -> Iterator[list[str]]:
    """The texts of `train` in a seeded random order, `batch` at a time."""
    order = np.random.default_rng(seed).permutation(len(train))
    for start in range(0, len(order), batch):
        yield train.select(order[start : start + batch])["text"]


def stream_corpus(source: dict, dev: int, test: int, rename_columns: str | None = None) -> Corpus:
    """`source` (`load_dataset` keyword arguments) read lazily: `dev` and `test` are the first `dev` and the next
    `test` documents of its train split, held in memory; training reads the documents after them. `rename_columns`
    (`"content=text"`) renames the stream's columns first (`user_data.column_renames`)."""
    from .user_data import column_renames
    from .validation import check_dataset_name, refusing_hub_ids_offline

    check_dataset_name(source.get("path"))
    with refusing_hub_ids_offline(source.get("path")):  # a stream reaches the Hub when it starts, or on its first read
        stream = load_dataset(**source, split="train", streaming=True)
        if rename_columns:
            columns = stream.column_names or list(next(iter(stream.take(1))))
            stream = stream.rename_columns(column_renames(rename_columns, columns, f"--dataset_name {source['path']}"))
        held_out = list(stream.take(dev + test))
    if len(held_out) < dev + test:
        raise ValueError(
            f"--streaming: the source holds {len(held_out)} documents, fewer than --dev_examples {dev} "
            f"+ --test_examples {test} held out before training"
        )
    texts = [row["text"] for row in held_out]
    splits = DatasetDict(
        {
            name: Dataset.from_dict({"text": part})
            for name, part in (("dev", texts[:dev]), ("test", texts[dev:]))
            if part
        }
    )
    files = file_signatures(source.get("data_files"))
    renamed = [rename_columns] if rename_columns else []  # an unrenamed stream keeps the key it had before the option
    return Corpus(splits, digest("stream", source, files, dev, test, *renamed), stream.skip(dev + test))


def prepared_tokenizer(corpus: Corpus, vocab_size: int, sample_mb: float, seed: int, root: Path):
    """The byte-level BPE tokenizer (digits split) trained on at most `sample_mb` MB of the corpus's training text,
    trained once per (corpus, vocab_size, sample, seed) and reused from the cache."""
    from .tokenization import load_tokenizer, train_tokenizer

    key = digest("tokenizer", corpus.fingerprint, vocab_size, sample_mb, seed)
    folder = root / "tokenizers" / key
    if (folder / "complete").exists():
        say("tokenizer reused from %s", folder)
        return load_tokenizer(str(folder))
    started = time.perf_counter()
    say("training a %d-token tokenizer on at most %s MB of the training text", vocab_size, sample_mb)

    def build(tmp: Path) -> None:
        texts = corpus.sample(int(sample_mb * 1e6), seed)
        train_tokenizer(texts, vocab_size=vocab_size, split_digits=True, show_progress=True).save_pretrained(tmp)
        (tmp / "complete").write_text("")

    publish(build, folder)
    say("tokenizer trained in %.1f s: %s", time.perf_counter() - started, folder)
    return load_tokenizer(str(folder))


def default_num_proc() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepared_blocks(
    data: DatasetDict,
    corpus: str,
    tokenizer,
    block_size: int,
    causal: bool,
    document_positions: bool,
    root: Path,
    num_proc: int | None = None,
) -> DatasetDict:
    """The splits of `data` tokenized and packed into blocks, prepared with `num_proc` processes the first time and
    memory-mapped from the cache every later time.

    Args:
        data (`DatasetDict`): Splits with a `text` column.
        corpus (`str`): The corpus fingerprint ([`corpus_fingerprint`]).
        tokenizer ([`PreTrainedTokenizerFast`]): The tokenizer; its fingerprint is part of the key.
        block_size (`int`): Tokens per block.
        causal (`bool`): Whether blocks carry `labels`.
        document_positions (`bool`): Whether blocks carry `position_ids` restarting per document.
        root (`Path`): The cache root ([`cache_root`]).
        num_proc (`int`, *optional*): Worker processes; defaults to the cores available.
    """
    key = digest(
        "blocks", corpus, tokenizer_fingerprint(tokenizer), block_size, causal, document_positions, PACKING_VERSION
    )
    folder = root / "blocks" / key
    if (folder / "complete").exists():
        try:
            blocks = load_blocks(folder)
        except DamagedCacheError as error:  # a shard cut short (a full disk, a copy killed): prepared again
            discard_damaged(folder, error)
        else:
            say("packed blocks reused from %s", folder)
            return blocks
    num_proc = num_proc or default_num_proc()
    started = time.perf_counter()

    options = {
        "tokenizer": tokenizer,
        "block_size": block_size,
        "causal": causal,
        "document_positions": document_positions,
    }

    # token ids and positions fit int32: half the disk and page cache of int64; rows read back as Python ints
    columns = ["input_ids", *(["position_ids"] if document_positions else []), *(["labels"] if causal else [])]
    features = Features({column: List(Value("int32")) for column in columns})

    def pack_split(name: str, split: Dataset, tmp: Path) -> Dataset:
        return split.map(
            pack,
            batched=True,
            batch_size=200,  # bounds each worker's memory: a batch of documents and its blocks
            remove_columns=split.column_names,
            num_proc=min(num_proc, max(1, len(split) // 200)),
            # the workers write the cached Arrow files themselves, in the folder (not datasets' cache): no copy
            cache_file_name=str(tmp / f"{name}.arrow"),
            desc=f"tokenizing and packing {name}",
            features=features,
            fn_kwargs=options,
        )

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        files = {}
        for name, split in data.items():
            packed = pack_split(name, split, tmp)
            files[name] = [Path(f["filename"]).name for f in packed.cache_files]  # the shards, in order
            del packed  # memory-mapped until released
        sizes = {shard: (tmp / shard).stat().st_size for shards in files.values() for shard in shards}
        write_json_atomic(tmp / SHARD_SIZES, sizes, indent=1)
        write_json_atomic(tmp / "complete", files, indent=1)

    publish(build, folder)
    say("tokenized and packed in %.1f s with %d processes: %s", time.perf_counter() - started, num_proc, folder)
    return load_blocks(folder)


# beside `complete`: each shard's size in bytes as written (a shard cut short at a record boundary still reads, as
# fewer blocks); a folder written before it has none, and versions before it ignore the file
SHARD_SIZES = "shard_sizes.json"


class DamagedCacheError(ValueError):
    """A published cache folder that cannot be read back whole (`damage`: a shard missing, cut short or unreadable);
    the message adds the remedy."""

    def __init__(self, damage: str, folder: Path):
        self.damage = damage
        super().__init__(
            f"{damage}; delete {folder} (it is prepared again on the next run) or give another --data_cache_dir"
        )


def load_blocks(folder: Path) -> DatasetDict:
    """The packed splits of a published blocks folder, memory-mapped from the shards its `complete` file lists.
    Raises `DamagedCacheError` naming the shard (and the remedy) when one is missing, of another size than was
    written (`SHARD_SIZES`), or not Arrow."""
    import pyarrow as pa

    try:
        files = json.loads((folder / "complete").read_text())
        sizes = json.loads((folder / SHARD_SIZES).read_text()) if (folder / SHARD_SIZES).exists() else {}
    except (OSError, ValueError) as error:
        raise DamagedCacheError(f"the corpus cache's {folder} is damaged (its record: {error})", folder) from None
    splits = {}
    for name, shards in files.items():
        parts = []
        for shard in shards:
            path = folder / shard
            found = path.stat().st_size if path.is_file() else None
            if found is None or (shard in sizes and found != sizes[shard]):
                what = "is missing" if found is None else f"holds {found} bytes of the {sizes[shard]} written"
                raise DamagedCacheError(f"the corpus cache's shard {path} {what}", folder)
            try:
                parts.append(Dataset.from_file(str(path)))
            except (pa.ArrowException, OSError) as error:  # ArrowInvalid: "Expected to read ... bytes"
                damage = f"the corpus cache's shard {path} is damaged ({type(error).__name__}: {error})"
                raise DamagedCacheError(damage, folder) from None
        splits[name] = concatenate_datasets(parts)
    return DatasetDict(splits)


def discard_damaged(folder: Path, error: DamagedCacheError) -> None:
    """Moves a damaged cache folder aside and removes it, so that it is prepared again; re-raises `error` (which names
    the shard and the remedy) when the folder cannot be moved (a read-only cache). Another process that moved it
    first is fine: the folder is gone either way."""
    aside = folder.parent / f".{folder.name}.{uuid.uuid4().hex[:8]}.damaged"
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return
    except OSError:
        raise error from None
    say("%s; preparing it again", error.damage)
    shutil.rmtree(aside, ignore_errors=True)
