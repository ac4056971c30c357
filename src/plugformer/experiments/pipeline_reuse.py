"""Whether `plugformer pipeline` reuses a finished stage: its record (`RECORD`, beside its `run_info.json`) holds
what shaped it (command line, YAML, parents' weights) and the digests of what it saved; a stage is reused only when
the first is unchanged, and refused, naming the file, when the second no longer matches its folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..runtime.files import MODEL_FILES, files_sha256, weights_sha256
from .pipeline_plan import needed_stages, stage_dir


if TYPE_CHECKING:
    from .pipeline import PipelineArguments


RECORD = "pipeline_stage.json"  # what shaped a finished stage, beside its run_info.json
WEIGHTS_KEY = "weights_sha256"  # in RECORD: the sha256 of the weights the stage saved (`runtime.files.weights_sha256`)
MODEL_FILES_KEY = "model_files_sha256"  # in RECORD: {name: sha256} of its config and tokenizer files (`MODEL_FILES`)


def model_file_digests(folder: str | Path) -> dict[str, str]:
    """`{name: sha256}` of the config, generation and tokenizer files (`runtime.files.MODEL_FILES`) atop `folder`."""
    names = sorted({path.name for pattern in MODEL_FILES for path in Path(folder).glob(pattern) if path.is_file()})
    return {name: files_sha256(folder, (name,)) for name in names}


def finished_record(args: PipelineArguments, stage: str, record: dict) -> dict:
    """`record` with the digests of the weights, config and tokenizer files the stage saved: reuse checks them."""
    folder = stage_dir(args, stage)
    return {**record, WEIGHTS_KEY: weights_sha256(folder), MODEL_FILES_KEY: model_file_digests(folder)}


def refuse_replaced_weights(folder: Path, stage: str, trained: str) -> None:
    """Raises `ValueError` naming both digests when the weights in a finished stage's folder are no longer those it
    saved (replaced after training): reusing it would report, and train the children of, another model."""
    current = weights_sha256(folder)
    if current != trained:
        found = f"weights sha256 {current[:12]}" if current else "no weights"
        raise ValueError(
            f"stage {stage!r}: {folder} now holds {found}, but the stage saved weights sha256 "
            f"{trained[:12]} ({RECORD}); the pipeline does not reuse replaced weights: restore them, or "
            "--rerun true to retrain"
        )


def digest_text(digest: str | None) -> str:
    return f"sha256 {digest[:12]}" if digest else "absent"


def refuse_changed_files(folder: Path, stage: str, saved: dict[str, str]) -> None:
    """Raises `ValueError` naming each config, generation or tokenizer file of a finished stage's folder that differs
    from what it saved (`saved`: `model_file_digests` then), with both digests: the same weights under an edited
    config.json (rope -> alibi) or another tokenizer compute something other than what was trained and scored."""
    current = model_file_digests(folder)
    changed = [
        f"{name} ({digest_text(saved.get(name))} when it finished, now {digest_text(current.get(name))})"
        for name in sorted(saved.keys() | current.keys())
        if saved.get(name) != current.get(name)
    ]
    if changed:
        raise ValueError(
            f"stage {stage!r}: {folder} changed since the stage finished: {', '.join(changed)} "
            f"({RECORD}); the pipeline does not reuse a folder that computes something other than "
            "what it trained and scored: restore the file, or --rerun true to retrain"
        )


def stage_record(args: PipelineArguments, stage: str, argv: list[str]) -> dict:
    """What shaped a stage: its command line (seeds, parents' folders), its YAML's sha256, and the weights it started
    from (the parents' parameter digests); a finished stage is reused only when all of it is unchanged."""
    config = Path(argv[argv.index("--config") + 1])
    digests = {}
    for parent in needed_stages(args, stage):
        info = Path(stage_dir(args, parent), "run_info.json")
        digests[parent] = json.loads(info.read_text()).get("parameter_digests") if info.exists() else None
    sha = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    return {"argv": argv, "config_sha256": sha, "parent_digests": digests}


def plan_stage(args: PipelineArguments, stage: str, record: dict) -> tuple[str, list[str]] | None:
    """None to reuse the finished stage, else (why it trains, extra command-line flags)."""
    folder = Path(stage_dir(args, stage))
    saved_path = folder / RECORD
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else None
    trained_weights = saved.pop(WEIGHTS_KEY, None) if saved is not None else None
    trained_files = saved.pop(MODEL_FILES_KEY, None) if saved is not None else None
    if (folder / "run_info.json").exists():
        if args.rerun:
            return "--rerun true", ["--overwrite_output_dir", "true"]
        if saved == record and trained_weights is None:
            return f"retraining: its {RECORD} records no weights sha256 to check the folder's weights against", [
                "--overwrite_output_dir",
                "true",
            ]
        if saved == record and trained_files is None:  # recorded before the config and tokenizer were checked
            return (
                f"retraining: its {RECORD} records no sha256 of config.json and the tokenizer files to check the "
                "folder's against",
                ["--overwrite_output_dir", "true"],
            )
        if saved == record:
            refuse_replaced_weights(folder, stage, trained_weights)
            refuse_changed_files(folder, stage, trained_files)
            return None
        changed = [key for key in record if saved is None or saved.get(key) != record[key]]
        why = f"its {RECORD} is missing" if saved is None else f"{', '.join(changed)} changed since it trained"
        return f"retraining: {why}", ["--overwrite_output_dir", "true"]
    if any(folder.glob("checkpoint-*")) and saved == record and not args.rerun:
        return "resuming its newest intact checkpoint", ["--resume_from_checkpoint", "last"]
    if folder.is_dir() and any(folder.iterdir()):
        return "replacing an unfinished run", ["--overwrite_output_dir", "true"]
    return "training", []
