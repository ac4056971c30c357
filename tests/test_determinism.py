"""Determinism: every training stage, run twice from the same seed, logs bitwise-identical losses and saves
bitwise-identical weights; another seed changes both (so the comparison can fail); a fresh process with another
Python hash seed trains the same tokenizer and model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_training import PRETRAIN, ROOT, TINY, length_reward, train, weights  # noqa: F401  (a fixture used below)

from plugformer.runtime.arguments import override_flags


# no dev evaluation or exact-match scoring: they follow training and cannot change what it produced
QUICK = ["--dev_examples", "0", "--exact_match_examples", "0"]
TIMINGS = ("runtime", "per_second", "step_time")  # wall-clock fields of the log history: they differ between runs


@pytest.fixture(scope="module")
def parents(tmp_path_factory) -> dict[str, Path]:
    """pretrain -> sft -> reward, the starting points of the other stages."""
    root = tmp_path_factory.mktemp("parents")
    dirs = {stage: root / stage for stage in ("pretrain", "sft", "reward")}
    train("pretrain", dirs["pretrain"], *QUICK)
    train("sft", dirs["sft"], "--model_name_or_path", str(dirs["pretrain"]), *QUICK)
    train("reward", dirs["reward"], "--model_name_or_path", str(dirs["sft"]), *QUICK)
    return dirs


def stage_arguments(stage: str, parents: dict[str, Path]) -> list[str]:
    parent = {"pretrain": None, "sft": "pretrain", "reward": "sft", "dpo": "sft", "grpo": "sft", "rlhf": "sft"}[stage]
    arguments = [] if parent is None else ["--model_name_or_path", str(parents[parent])]
    if stage == "grpo":
        arguments += ["--reward_functions", "length"]
    if stage == "rlhf":
        arguments += ["--reward_model_path", str(parents["reward"])]
    return arguments


def log_history(directory: Path) -> list[dict]:
    """`trainer_state.json`'s log history without its wall-clock fields."""
    history = json.loads((directory / "trainer_state.json").read_text())["log_history"]
    return [{k: v for k, v in entry.items() if not any(t in k for t in TIMINGS)} for entry in history]


def losses(history: list[dict]) -> list[float]:
    return [entry[key] for entry in history for key in sorted(entry) if "loss" in key]


def assert_identical_runs(first: Path, second: Path) -> None:
    assert log_history(first) == log_history(second)  # JSON floats round-trip: equal means bitwise equal
    before, after = weights(first), weights(second)
    assert before.keys() == after.keys()
    assert [name for name in before if not torch.equal(before[name], after[name])] == []


STAGE_VARIANTS = [
    pytest.param(stage, [], id=stage) for stage in ("pretrain", "sft", "reward", "dpo", "grpo", "rlhf")
] + [
    # dropout draws from the seeded generator too
    pytest.param("pretrain", ["--config_overrides", "attention_dropout=0.1,hidden_dropout=0.1"], id="pretrain-dropout"),
]


@pytest.mark.usefixtures("length_reward")
@pytest.mark.parametrize("stage,extra", STAGE_VARIANTS)
def test_the_same_seed_trains_the_same_model_twice(parents, tmp_path, stage, extra):
    arguments = [*stage_arguments(stage, parents), *QUICK, *extra]
    for run in ("first", "second"):
        train(stage, tmp_path / run, *arguments, "--seed", "42")
    assert len(losses(log_history(tmp_path / "first"))) >= 3  # a loss per step and the run's mean
    assert_identical_runs(tmp_path / "first", tmp_path / "second")
    if stage == "pretrain":  # the tokenizer is trained too
        assert (tmp_path / "first/tokenizer.json").read_bytes() == (tmp_path / "second/tokenizer.json").read_bytes()
    # the seed reaches the run: another one changes the losses (initialisation, data order, sampling, dropout)
    train(stage, tmp_path / "other", *arguments, "--seed", "43")
    assert losses(log_history(tmp_path / "other")) != losses(log_history(tmp_path / "first"))


def test_a_fresh_process_with_another_hash_seed_pretrains_the_same_tokenizer_and_model(tmp_path):
    """Set and dict orders of strings follow PYTHONHASHSEED, which differs between processes: nothing on the way
    from text to weights (tokenizer training, packing, sampling) may depend on them."""
    train("pretrain", tmp_path / "here", *QUICK)
    command = [
        sys.executable,
        "-m",
        "plugformer",
        "train",
        "pretrain",
        "--output_dir",
        str(tmp_path / "fresh"),
        *override_flags(TINY, PRETRAIN, QUICK),
    ]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "12345"}
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert_identical_runs(tmp_path / "here", tmp_path / "fresh")
    assert (tmp_path / "here/tokenizer.json").read_bytes() == (tmp_path / "fresh/tokenizer.json").read_bytes()
