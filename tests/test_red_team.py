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


# --- convert: never onto its source, never "saved" without saving ------------------------------------------------


@pytest.fixture
def llama_source(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "source")
    return tmp_path / "source"


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("target", "pattern"),
    [
        (lambda src: src, "is the source"),
        (lambda src: src / "plugformer", "is inside the source"),
        (lambda src: src / "config.json", "is the source|inside the source"),
        (lambda src: src.parent / "afile", "is an existing file"),
        (lambda src: src.parent / "occupied", r"already holds a model \(config.json"),
    ],
    ids=["source", "inside-source", "a-source-file", "a-file", "occupied"],
)
def test_convert_refuses_to_overwrite_the_source_or_save_nothing(llama_source, target, pattern):
    from plugformer.convert import convert

    (llama_source.parent / "afile").write_text("keep me\n")
    (llama_source.parent / "occupied").mkdir()
    (llama_source.parent / "occupied" / "config.json").write_text("{}\n")
    before = snapshot(llama_source.parent)
    with pytest.raises(ValueError, match=rf"output_dir=.*({pattern})"):
        convert(llama_source, target(llama_source))
    assert snapshot(llama_source.parent) == before  # nothing written, nothing lost


def test_convert_overwrite_replaces_an_occupied_folder(llama_source):
    from plugformer.convert import convert

    occupied = llama_source.parent / "occupied"
    convert(llama_source, occupied)
    with pytest.raises(ValueError, match="already holds a model"):
        convert(llama_source, occupied)
    convert(llama_source, occupied, overwrite=True, position_scheme="alibi")
    assert '"alibi"' in (occupied / "config.json").read_text()
    with pytest.raises(ValueError, match="is the source"):  # not even with overwrite
        convert(llama_source, llama_source, overwrite=True)


# --- training output folders: one run each, one live process each ------------------------------------------------


def pretrain(output_dir, *extra: str) -> dict:
    from test_training import PRETRAIN, TINY

    from plugformer.training import run_stage

    steps = ["--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "no", "--dev_examples", "0",
             "--exact_match_examples", "0", "--max_steps", "2"]  # fmt: skip
    return run_stage("pretrain", ["--output_dir", str(output_dir), *TINY, *PRETRAIN, *steps, *extra])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step pretraining run with checkpoint-2 (its folder is copied, never written to)."""
    directory = tmp_path_factory.mktemp("finished") / "run"
    pretrain(directory)
    return directory


def copy_of(run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_a_second_run_into_an_occupied_folder_is_refused_before_training(finished, tmp_path, monkeypatch):
    from plugformer.training import pretrain as pretrain_module

    run = copy_of(finished, tmp_path)
    before = snapshot(run)
    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_training)
    with pytest.raises(ValueError, match=r"--output_dir .* already holds another run \(checkpoint-2, config.json.*"
                                         r"--resume_from_checkpoint last.*--overwrite_output_dir true"):  # fmt: skip
        pretrain(run, "--seed", "1")
    assert snapshot(run) == before


def test_resuming_the_same_run_and_an_explicit_overwrite_still_train(finished, tmp_path, caplog):
    import json
    import logging

    run = copy_of(finished, tmp_path)
    pretrain(run, "--resume_from_checkpoint", "last", "--max_steps", "4")  # continues the run: 2 more steps
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    with caplog.at_level(logging.WARNING, logger="plugformer.training.outputs"):
        pretrain(run, "--overwrite_output_dir", "true", "--save_steps", "1")
    assert "removing ['checkpoint-2', 'checkpoint-4', 'run_info.json']" in caplog.text
    # only the new run's checkpoints: rotation and `last` can never pick the old run's
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 2
    with pytest.raises(ValueError, match="contradict"):
        pretrain(run, "--overwrite_output_dir", "true", "--resume_from_checkpoint", "last")


def test_a_live_run_locks_its_folder_and_a_dead_ones_lock_is_taken_over(tmp_path, caplog, monkeypatch):
    import json
    import logging
    import socket
    import subprocess
    import sys

    from plugformer.training import pretrain as pretrain_module
    from plugformer.training.outputs import LOCK

    lock = tmp_path / "run" / LOCK
    lock.parent.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(), "started": "then"}))
        with monkeypatch.context() as patch:
            patch.setattr(pretrain_module, "build_tokenizer", refuse_training)
            with pytest.raises(ValueError, match=rf"in use by a live run \(pid {live.pid}"):
                pretrain(tmp_path / "run")
        assert json.loads(lock.read_text())["pid"] == live.pid  # the live run's lock is left alone
    finally:
        live.kill()
        live.wait()
    with caplog.at_level(logging.WARNING, logger="plugformer.training.outputs"):
        pretrain(tmp_path / "run")  # the same pid, now dead: a killed run's stale lock
    assert f"left by pid {live.pid}, which is no longer running; taking it over" in caplog.text
    assert not lock.exists()  # released when the run ended
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    with pytest.raises(ValueError, match=r"locked by pid 1 on host elsewhere .* delete"):
        pretrain(tmp_path / "run", "--resume_from_checkpoint", "last")
