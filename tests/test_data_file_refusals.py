"""Data files given to a stage are checked before training: an empty, blank or non-UTF-8 JSONL file, a null text, a
missing file, columns the stage cannot use and a split shorter than one block are refused naming the file and what
is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import pretrain_checkpointed as pretrain
from conftest import refuse_training


def jsonl(path: Path, rows: list) -> Path:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"", "the file is empty"),
        (b"\n  \n", "the file is empty"),
        ('{"text": "caf\xe9 au lait"}\n'.encode("latin-1"), r"not UTF-8 text \(byte 13 is b'\\xe9'\)"),
        (b'{"text": "a"}\n{"text": null}\n', r"column 'text' is null in row 1 of the train split"),
    ],
    ids=["empty", "blank", "latin-1", "null-text"],
)
def test_bad_jsonl_is_named_before_training(tmp_path, monkeypatch, content, pattern):
    from plugformer.training.stages import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_training)
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    with pytest.raises(ValueError, match=rf"--data_files {data}: {pattern}|--data_files {data}.*{pattern}"):
        pretrain(
            tmp_path / "run",
            "--dataset_name",
            "json",
            "--data_files",
            str(data),
            "--dev_examples",
            "0",
            "--test_examples",
            "0",
        )


def test_missing_data_file_and_sft_with_other_columns_are_named(finished, tmp_path, monkeypatch):
    from plugformer.training import common, run_stage

    monkeypatch.setattr(common, "atomic_checkpoints", refuse_training)  # the trainer is never built
    argv = ["--output_dir", str(tmp_path / "sft"), "--model_name_or_path", str(finished), "--dataset_name", "json"]
    with pytest.raises(ValueError, match=r"--data_files .*nowhere.jsonl: no such file"):
        run_stage("sft", [*argv, "--data_files", str(tmp_path / "nowhere.jsonl")])
    data = jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(40)])
    with pytest.raises(
        ValueError,
        match=r"stage 'sft' needs the columns text \| messages \| prompt\+completion"
        r".*it has \['question', 'answer'\]",
    ):
        run_stage("sft", [*argv, "--data_files", str(data), "--dev_examples", "2", "--test_examples", "2"])


@pytest.mark.parametrize(
    ("flags", "split"),
    [
        (["--dev_examples", "1", "--block_size", "128"], "dev"),
        (["--train_examples", "1", "--block_size", "128"], "train"),
    ],
)
def test_a_split_shorter_than_one_block_is_refused_before_training(tmp_path, monkeypatch, flags, split):
    from transformers import Trainer

    monkeypatch.setattr(Trainer, "train", refuse_training)
    with pytest.raises(ValueError, match=rf"the {split} split \(1 documents\) holds fewer than block_size=\d+ tokens"):
        pretrain(tmp_path / "run", "--eval_strategy", "steps", "--eval_steps", "1", *flags)
    assert not (tmp_path / "run" / "checkpoint-2").exists()
