"""What plugformer writes is whole or not there: JSON state and results are published by a rename (a failed write
keeps the previous file), a full disk is one line naming what was being written, the space free and what is intact,
and a failure after training keeps the saved model, saying where."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import pretrain_checkpointed as pretrain


ROOT = Path(__file__).resolve().parents[1]


def test_a_failed_state_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno
    import json

    from plugformer.runtime import files

    state = tmp_path / "run_info.json"
    files.write_json_atomic(state, {"step": 1})

    def disk_full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        files.write_json_atomic(state, {"step": 2, "padding": "x" * 10_000})
    assert json.loads(state.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run_info.json"]


def test_run_state_and_eval_results_are_published_by_a_rename(finished, tmp_path, monkeypatch):
    import os

    from plugformer.cli import main

    renamed = []
    real_replace = os.replace

    def recording_replace(source, target, *args, **kwargs):
        renamed.append(Path(target).name)
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", recording_replace)
    pretrain(tmp_path / "run")
    assert {"run_info.json", "trainer_state.json", "last_checkpoint.json"} <= set(renamed)
    main(["eval", "--model", str(tmp_path / "run"), "--examples", "2", "--max_new_tokens", "4"])
    assert "eval_test.json" in renamed


def test_no_json_file_is_written_in_place():
    """Every JSON file plugformer writes goes through `plugformer.runtime.files` (a temporary file renamed over the target):
    no `write_text(json.dumps(...))` or `json.dump(..., handle)` is left in the package."""
    import re

    in_place = re.compile(r"write_text\(\s*json\.dumps|json\.dump\(|\.save_to_json\(")
    offenders = []
    for path in sorted((ROOT / "src" / "plugformer").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if in_place.search(line) and "staged" not in line:  # inside a checkpoint's staging area: published whole
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_an_evaluation_failure_after_training_keeps_the_saved_model_and_says_where(tmp_path, monkeypatch, caplog):
    """The dev evaluation ran before the final save: an error there lost the whole training run."""
    import logging

    from transformers import Trainer

    def broken_evaluate(*_, **__):
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(Trainer, "evaluate", broken_evaluate)
    with caplog.at_level(logging.ERROR, logger="plugformer.training.common"), pytest.raises(RuntimeError) as raised:
        pretrain(tmp_path / "run", "--dev_examples", "8", "--block_size", "16")
    assert (tmp_path / "run" / "model.safetensors").is_file() and (tmp_path / "run" / "config.json").is_file()
    where = f"the trained model is saved in {tmp_path / 'run'}"
    assert any(where in note for note in raised.value.__notes__) and where in caplog.text
    assert not (tmp_path / "run" / "run_info.json").exists()  # not recorded as a finished stage


def full_disk_cli(tmp_path, capsys, monkeypatch, *flags) -> str:
    """A 4-step pretraining run through the CLI (checkpoints at steps 2 and 4) under a disk that fills as set up by
    the caller; returns the one line printed."""
    import shutil

    from test_training import PRETRAIN, TINY

    from plugformer.runtime.arguments import override_flags

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=12_345))  # what a full disk reports
    steps = [
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--eval_strategy",
        "no",
        "--dev_examples",
        "0",
        "--exact_match_examples",
        "0",
        "--max_steps",
        "4",
    ]
    argv = [
        "train",
        "pretrain",
        *override_flags(["--output_dir", str(tmp_path / "run"), *TINY, *PRETRAIN], steps, list(flags)),
    ]
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    error = capsys.readouterr().err  # the data-loading progress bars come before the error on stderr
    assert exited.value.code == 2 and "Traceback" not in error
    return error.strip().splitlines()[-1]


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_and_says_so(tmp_path, capsys, monkeypatch):
    """torch.save's short write ('PytorchStreamWriter failed writing file ...') reached the user as raw torch text,
    with the partial checkpoint left in the staging area."""
    import torch

    from plugformer.training.checkpoints import STAGING, verify_checkpoint

    real_save = torch.save

    def filling_save(value, path, *args, **kwargs):
        if "checkpoint-4" in str(path):
            Path(path).write_bytes(b"partial")
            raise RuntimeError(
                "[enforce fail at inline_container.cc:659] . PytorchStreamWriter failed writing file "
                "data/0: file write failed"
            )
        return real_save(value, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", filling_save)
    line = full_disk_cli(tmp_path, capsys, monkeypatch)
    run = tmp_path / "run"
    assert line.startswith(
        f"DiskFullError: [Errno 28] writing a checkpoint to {run / 'checkpoint-4'}: the disk is full"
    )
    assert "12.1 KiB free on the file system of" in line
    assert "checkpoint-2 (step 2) is intact: free some space and resume with --resume_from_checkpoint last" in line
    assert verify_checkpoint(run / "checkpoint-2") is None  # the earlier checkpoint really is whole
    assert not (run / "checkpoint-4").exists() and not (run / STAGING).exists()  # the partial one is gone


def test_a_full_disk_during_the_final_save_names_the_folder_and_the_intact_checkpoint(tmp_path, capsys, monkeypatch):
    """safetensors' IoError on the final model, and an ENOSPC from a state file, each get one line."""
    import errno

    import transformers.modeling_utils
    from safetensors import SafetensorError

    from plugformer.runtime import files

    real_save_file = transformers.modeling_utils.safe_save_file

    def filling_save_file(tensors, filename, *args, **kwargs):
        if ".staging" not in str(filename):  # checkpoints go through the staging area; the final model does not
            raise SafetensorError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                'space left on device" })'
            )
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", filling_save_file)
    line = full_disk_cli(tmp_path, capsys, monkeypatch)
    assert line.startswith(
        f"DiskFullError: [Errno 28] writing the trained model to {tmp_path / 'run'}: the disk is "
        "full (No space left on device)"
    )
    assert "the model files in it are incomplete; checkpoint-4 (step 4) is intact" in line

    state = tmp_path / "run_info.json"
    files.write_json_atomic(state, {"step": 1})

    def no_space(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", no_space)
    with pytest.raises(
        files.DiskFullError,
        match=r"writing run_info.json to .*run_info.json: the disk is full .* "
        r"free on .*; the previous run_info.json is intact",
    ):
        files.write_json_atomic(state, {"step": 2})
    assert state.read_text() == '{"step": 1}\n'


def test_only_out_of_space_errors_are_renamed():
    import errno

    from plugformer.runtime.files import is_out_of_space

    assert is_out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"), "/")
    assert not is_out_of_space(OSError(errno.EACCES, "Permission denied"), "/")
    assert not is_out_of_space(RuntimeError("PytorchStreamWriter failed writing file data/0"), "/")  # space is free
    assert not is_out_of_space(ValueError("something else"), "/")
