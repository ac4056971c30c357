"""Checkpoints survive kills: published whole or not at all, verified on resume, and resumed runs end bit-identical."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_training import PRETRAIN, ROOT, TINY, weights

from plugformer.runtime.arguments import override_flags
from plugformer.training import run_stage
from plugformer.training.checkpoints import MANIFEST, STAGING, last_good_checkpoint, verify_checkpoint


KILLS = int(os.environ.get("PLUGFORMER_KILLS", "3"))  # PLUGFORMER_KILLS=20 for a longer hunt
STEPS = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "no",
         "--dev_examples", "0", "--exact_match_examples", "0"]  # fmt: skip


def pretrain(output_dir: Path, *extra: str) -> dict:
    return run_stage(
        "pretrain", override_flags(["--output_dir", str(output_dir), *TINY, *PRETRAIN], STEPS, list(extra))
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An uninterrupted 6-step run keeping every checkpoint (2, 4, 6)."""
    directory = tmp_path_factory.mktemp("whole")
    pretrain(directory)
    return directory


def test_checkpoints_are_published_with_a_manifest_and_nothing_left_staged(finished_run):
    checkpoints = sorted(p.name for p in finished_run.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for name in checkpoints:
        assert verify_checkpoint(finished_run / name) is None
        manifest = json.loads((finished_run / name / MANIFEST).read_text())
        assert {"model.safetensors", "trainer_state.json", "optimizer.pt"} <= set(manifest)
        assert not list((finished_run / name).glob("pytorch_model*"))  # model weights only as safetensors
    assert not (finished_run / STAGING).exists()  # nothing staged is left, not even the empty folder


def test_rotation_keeps_the_limit_and_the_newest(tmp_path):
    pretrain(tmp_path, "--save_total_limit", "1")
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-6"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(finished_run, tmp_path, caplog, damage):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    target = copy / "checkpoint-6" / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete":
        (copy / "checkpoint-6" / "optimizer.pt").unlink()
    else:
        (copy / "checkpoint-6" / MANIFEST).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):
        assert last_good_checkpoint(copy) == str(copy / "checkpoint-4")
    assert "skipping" in caplog.text and "checkpoint-6" in caplog.text
    with pytest.raises(ValueError, match="resume_from_checkpoint"):
        pretrain(tmp_path / "other", "--resume_from_checkpoint", str(copy / "checkpoint-6"))


def test_resuming_past_a_damaged_checkpoint_ends_bit_identical(finished_run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    for name in ("model.safetensors", "run_info.json", "trainer_state.json"):  # as if killed after checkpoint 6
        (copy / name).unlink()
    weights_file = copy / "checkpoint-6" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[: len(weights_file.read_bytes()) // 2])
    pretrain(copy, "--resume_from_checkpoint", "last")  # from checkpoint 4
    whole, resumed = weights(finished_run), weights(copy)
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    assert verify_checkpoint(copy / "checkpoint-6") is None  # rewritten whole by the resumed run


def test_a_plain_trainer_checkpoint_is_checked_without_a_manifest(finished_run, tmp_path):
    import shutil

    legacy = tmp_path / "checkpoint-4"
    shutil.copytree(finished_run / "checkpoint-4", legacy)
    (legacy / MANIFEST).unlink()
    assert verify_checkpoint(legacy) is None
    weights_file = legacy / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-64])
    assert "unreadable" in verify_checkpoint(legacy)


def test_best_checkpoint_points_at_the_published_directory(tmp_path):
    pretrain(
        tmp_path,
        "--dev_examples",
        "8",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--metric_for_best_model",
        "eval_loss",
        "--load_best_model_at_end",
        "true",
        "--save_total_limit",
        "1",
    )
    state = json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())
    assert Path(state["best_model_checkpoint"]).parent == tmp_path and STAGING not in state["best_model_checkpoint"]
    assert Path(state["best_model_checkpoint"]).is_dir()  # rotation keeps the best one


def test_killed_at_random_moments_and_resumed_ends_bit_identical(tmp_path):
    """SIGKILL a real run at random moments (often mid-save or mid-rotation), resume with `last` each time: every
    checkpoint directory stays intact, and the final weights equal an uninterrupted run's."""
    flags = override_flags(
        [*TINY, *PRETRAIN],
        [
            "--max_steps",
            str(30 * KILLS),
            "--save_strategy",
            "steps",
            "--save_steps",
            "3",
            "--save_total_limit",
            "2",
            "--eval_strategy",
            "no",
            "--dev_examples",
            "0",
            "--exact_match_examples",
            "0",
        ],
    )
    run_stage("pretrain", ["--output_dir", str(tmp_path / "whole"), *flags])
    killed = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "plugformer",
        "train",
        "pretrain",
        "--output_dir",
        str(killed),
        *flags,
        "--resume_from_checkpoint",
        "last",
    ]
    rng, kills = random.Random(0), 0
    while kills < KILLS:
        newest = max((int(p.name.split("-")[1]) for p in killed.glob("checkpoint-*")), default=0)
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        deadline = time.time() + 120
        # wait for progress past the checkpoint it resumed from, then kill at a random moment (often mid-save)
        while not (killed / f"checkpoint-{newest + 3}").exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))
        if process.poll() is not None:  # finished before the kill: nothing left to interrupt
            break
        process.send_signal(signal.SIGKILL)
        process.wait()
        kills += 1
        for checkpoint in killed.glob("checkpoint-*"):
            assert verify_checkpoint(checkpoint) is None, checkpoint
    assert kills == KILLS, f"the run finished before it was interrupted {KILLS} times"
    run_stage("pretrain", ["--output_dir", str(killed), *flags, "--resume_from_checkpoint", "last"])
    whole, resumed = weights(tmp_path / "whole"), weights(killed)
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
