"""Red-team cases of issue 18: each hostile input at an entry point (CLI flags, output folders, checkpoints, data)
gets a one-line error naming the input and what is allowed, before any training starts, or works correctly."""

from __future__ import annotations

from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
CONFIGS = str(ROOT / "configs" / "{stage}" / "tiny.yaml")


def refuse_training(*_, **__):
    raise AssertionError("training started")


# --- compare: options it sets per run ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "entry", "allowed"),
    [
        ("set", "seed=7", "--seeds"),
        ("set", "pretrain.seed=7", "--seeds"),
        ("set", "output_dir=/tmp/one", "--output_dir"),
        ("set", "dataset_seed=3", "--dataset_seed"),
        ("set", "model_name_or_path=/tmp/x", "--stages"),
        ("grid", "seed=1,2", "--seeds"),
    ],
)
def test_compare_refuses_options_it_sets_per_run(tmp_path, monkeypatch, where, entry, allowed):
    from plugformer.evaluation import compare

    monkeypatch.setattr("plugformer.training.run_stage", refuse_training)
    kwargs = {"set": [entry]} if where == "set" else {"grid": [entry]}
    args = compare.CompareArguments(output_dir=str(tmp_path), seeds=[0, 1], stage_configs=CONFIGS, **kwargs)
    name = entry.partition("=")[0].rpartition(".")[2]
    with pytest.raises(ValueError, match=rf"--{where} {entry.split(',')[0]}.*compare sets {name!r} itself.*{allowed}"):
        compare.run(args)
    assert not (tmp_path / "runs").exists()
