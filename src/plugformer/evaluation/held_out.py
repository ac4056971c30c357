"""Your own data in `plugformer eval`: what a stage's run read (`data_record`, in its `run_info.json`), the dev or test
split it held out of that source (or of one given to `plugformer eval`), and the perplexity of completions given
their prompts; `evaluators.user_data_scores` scores the split by what its columns allow.

The held-out rows are those the run never trained on: a split of the source's own (`test`, `validation`), else the
rows carved from train with the run's sizes and seed (`data.sources.load_stage_dataset`), or, for a streamed corpus,
its first `dev_examples` and next `test_examples` documents.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

from ..data.formats import BUILDERS
from .implicit_reward import completion_log_probs, completion_token_ids, padded_batch


logger = logging.getLogger(__name__)

DEFAULT_HELD_OUT = 200  # a stage's --dev_examples / --test_examples default (`StageArguments`)


def data_record(script_args) -> dict:
    """What a stage's run read, for `run_info.json`: the embedded task's seed and share of bare answers, or your
    source (local paths made absolute, so `plugformer eval` finds them from any folder; a builder name such as `text`
    stays a name, as `load_dataset` reads it even beside a folder of that name) and how it was split: the held-out
    sizes carved, which may be fewer than `--dev_examples`/`--test_examples` (`held_out_sizes` keeps those caps)."""
    if script_args.dataset_name is None:
        return {"dataset_seed": script_args.dataset_seed, "direct_answer_fraction": script_args.direct_answer_fraction}
    name = script_args.dataset_name
    identity = getattr(script_args, "data_identity", None) or {}
    # the sizes carved (scaled to the data: `identity.held_out_sizes`), which eval carves again as they are
    used = identity.get("held_out_sizes") or {}
    return {
        **identity,  # files' and held-out rows' digests (`data.identity`)
        "dataset_name": os.path.abspath(name) if name not in BUILDERS and Path(name).exists() else name,
        "dataset_config": script_args.dataset_config,
        "data_files": [os.path.abspath(f) for f in script_args.data_files] if script_args.data_files else None,
        "dataset_seed": script_args.dataset_seed,
        "rename_columns": script_args.rename_columns,
        "dev_examples": used.get("dev", script_args.dev_examples),
        "test_examples": used.get("test", script_args.test_examples),
        "streaming": bool(getattr(script_args, "streaming", False)),
        "keep_duplicates": bool(getattr(script_args, "keep_duplicates", False)),
    }


def recorded_source(model: str) -> dict | None:
    """The source a stage directory's run trained on (`data_record`), or None: the embedded task, or no record."""
    info = Path(model, "run_info.json")
    record = json.loads(info.read_text()).get("data") if info.is_file() else None
    return record if isinstance(record, dict) and record.get("dataset_name") else None


def recorded_held_out_texts(model: str | Path, split: str) -> list[str] | None:
    """The `split` documents the run in `model` held out of its own corpus, checked against the digest it recorded
    (`held_out_rows`: found by content when the corpus changed, else refused), or None when the run recorded none
    (the embedded data, or a run older than the record)."""
    source = recorded_source(str(model))
    if source is None or not source.get("held_out"):
        return None
    return list(held_out_rows(source, split, source[f"{split}_examples"])["text"])


def data_source(args) -> dict | None:
    """The source `plugformer eval` scores: `--dataset_name` (with `--data_files`, `--dataset_config`), else the one
    the model's run trained on; None for the embedded task. `--dev_examples` / `--test_examples` default to the
    run's carving (else 200 each), `--dataset_seed` to the run's when the source is the run's."""
    recorded = recorded_source(args.model)
    if args.dataset_name is None and recorded is None:
        info = Path(args.model, "run_info.json")
        if info.is_file() and "data" not in json.loads(info.read_text()):  # before runs recorded their source
            logger.warning(
                "%s records no data source (a run older than the record): scoring the embedded task; if "
                "it trained on your own data, give --dataset_name and --data_files",
                info,
            )
        return None
    if args.dataset_name is None:
        source = dict(recorded)
    else:
        from ..data.identity import files_record

        source = {
            "dataset_name": args.dataset_name,
            "dataset_config": args.dataset_config,
            "data_files": args.data_files,
            "dataset_seed": args.dataset_seed,
            "streaming": False,
            "rename_columns": args.rename_columns,
            "files": files_record(args.dataset_name, args.data_files),
        }
    for split in ("dev", "test"):
        given = getattr(args, f"{split}_examples")
        fallback = (recorded or {}).get(f"{split}_examples", DEFAULT_HELD_OUT)
        if args.dataset_name is None and given is not None and given != fallback and recorded.get("held_out"):
            raise ValueError(
                f"--{split}_examples {given}: the run held out {fallback} {split} rows of its data "
                f"({args.model}/run_info.json); another count carves other rows, some of which it "
                "trained on. Drop the flag (--examples scores fewer), or give the data to score with "
                "--dataset_name"
            )
        source[f"{split}_examples"] = fallback if given is None else given
    return source


def held_out_rows(source: dict, split: str, examples: int):
    """The first `examples` rows of `split` (`dev` or `test`) held out of `source` as the run held them out."""
    from datasets import Dataset, load_dataset

    from ..data.user_data import column_renames, load_user_splits
    from ..data.validation import refusing_hub_ids_offline

    if split not in ("dev", "test"):
        raise ValueError(f"--split {split}: your own data is scored on what training held out: dev or test")
    dev, test = source["dev_examples"], source["test_examples"]
    splits = None
    if source.get("streaming"):  # the stream's first `dev` documents, then the next `test`
        with refusing_hub_ids_offline(source["dataset_name"]):
            stream = load_dataset(
                source["dataset_name"],
                source["dataset_config"],
                data_files=source["data_files"],
                split="train",
                streaming=True,
            )
            held = list(stream.take(dev + test))
        rows = Dataset.from_list(held[:dev] if split == "dev" else held[dev:])
        if source.get("rename_columns"):
            rows = rows.rename_columns(column_renames(source["rename_columns"], rows.column_names))
    else:
        carving = "content" if "files" in source else "position"  # a record older than the files' digests
        if carving == "position":
            logger.warning(
                "%s: its run recorded no digests (a run older than them): scoring the %s rows carved by "
                "position, as that run carved them; they cannot be checked against the data as it is now",
                source["dataset_name"],
                split,
            )
        with refusing_hub_ids_offline(source["dataset_name"]):
            splits = load_user_splits(
                "conversation",
                source["dataset_name"],
                source["dataset_config"],
                source["data_files"],
                {"dev": dev, "test": test},
                source["dataset_seed"],
                source.get("rename_columns"),
                bool(source.get("keep_duplicates")),
                carving=carving,
            )
        if split not in splits:
            raise ValueError(
                f"--split {split}: {source['dataset_name']} holds no {split} split and none was carved "
                f"(--{split}_examples 0)"
            )
        rows = splits[split]
    recorded = (source.get("held_out") or {}).get(split)
    if recorded:
        rows = recorded_rows(rows, splits, recorded, source, split)
    if len(rows) == 0:
        raise ValueError(f"--split {split}: no {split} rows held out of {source['dataset_name']}")
    return rows.select(range(min(examples, len(rows))))


def recorded_rows(rows, splits, recorded: dict, source: dict, split: str):
    """The rows a run held out as `split` (`identity.held_out_record`): `rows` when their digest is the recorded one,
    else the recorded rows found by content in the data as it is now (`splits`: every row is searched), in their
    recorded order, with a warning naming what changed. Raises `ValueError` naming the files and both digests when a
    recorded row is gone: another split would score rows the model may have trained on."""
    from datasets import concatenate_datasets

    from ..data.identity import KEY_HEX, row_keys, split_digest

    keys = row_keys(rows)
    if split_digest(keys) == recorded["sha256"]:
        return rows
    changed = changed_files(source)
    if splits is not None:
        everything = concatenate_datasets([part for part in splits.values()])
        index = {}
        for position, key in enumerate(row_keys(everything)):
            index.setdefault(key[:KEY_HEX], position)
        found = [index.get(key) for key in recorded["row_keys"]]
        if None not in found:
            logger.warning(
                "%s changed since the run (%s): scoring the %d %s rows it held out, found by content",
                source["dataset_name"],
                changed,
                len(found),
                split,
            )
            return everything.select(found)
        missing = found.count(None)
    else:
        missing = "some"
    raise ValueError(
        f"--split {split}: the data changed since the run ({changed}); {missing} of the "
        f"{len(recorded['row_keys'])} {split} rows it held out (sha256 {recorded['sha256'][:12]}) are no "
        f"longer in it (its {split} split now: sha256 {split_digest(keys)[:12]}), so another split would "
        "score rows the model may have trained on. Restore the files, or give the data to score with "
        "--dataset_name/--data_files"
    )


def changed_files(source: dict) -> str:
    """The files of `source` whose sha256 differs from the one its run recorded, with both digests, as text."""
    from ..data.identity import files_record

    recorded = {record["path"]: record["sha256"] for record in source.get("files") or []}
    try:
        now = {
            record["path"]: record["sha256"]
            for record in files_record(source["dataset_name"], source.get("data_files"))
        }
    except ValueError as error:
        return str(error)
    parts = [
        f"{path}: sha256 {recorded.get(path, 'none')[:12]} then, {now.get(path, 'none')[:12]} now"
        for path in sorted(set(recorded) | set(now))
        if recorded.get(path) != now.get(path)
    ]
    return "; ".join(parts) or "its files are unchanged, but the rows read from them differ"


def prompts_and_completions(rows) -> tuple[list, list]:
    """(prompts, completions) of `prompt`/`completion` rows, or of `messages` rows split before their last turn
    (which must be the assistant's)."""
    if "completion" in rows.column_names:
        return list(rows["prompt"]), list(rows["completion"])
    prompts, completions = [], []
    for number, messages in enumerate(rows["messages"]):
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError(
                f"row {number} of the held-out split: its messages do not end with an assistant turn, "
                "so there is no reply to score"
            )
        prompts.append(messages[:-1])
        completions.append(messages[-1:])
    return prompts, completions


def completion_perplexity(model, tokenizer, prompts: list, completions: list, batch_size: int = 32) -> dict:
    """exp of the mean loss over the completions' tokens given their prompts (through the chat template for
    conversations), with each completion's summed loss (nats) and token count: the paired tests compare on them."""
    losses, counts = [], []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        pairs = zip(prompts[start : start + batch_size], completions[start : start + batch_size], strict=True)
        rows = [completion_token_ids(tokenizer, p, c) for p, c in pairs]
        ids, mask, starts = padded_batch(rows, tokenizer.pad_token_id)
        losses += (-completion_log_probs(model, ids, mask, starts)).tolist()
        counts += [len(row_ids) - begin for row_ids, begin in rows]
    return {
        "completion_perplexity": math.exp(sum(losses) / max(sum(counts), 1)),
        "completion_losses": losses,
        "completion_tokens": counts,
    }


def rows_digest(rows) -> str:
    """The sha256 of a split's rows (every column, in order): equal digests, the same examples scored."""
    return hashlib.sha256(json.dumps(rows.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
