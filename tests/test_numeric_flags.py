"""Counts and numbers a command would misread are refused before any work, naming the flag and what is allowed:
negative or zero counts, non-finite or out-of-range rates (in one line at the command line), no test split where one
is needed, and an architecture flag that contradicts `--config_overrides`."""

from __future__ import annotations

import re

import pytest
from conftest import pretrain_checkpointed as pretrain
from conftest import refuse_training, refuse_work


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (["--max_steps", "-5"], r"--max_steps -5: expected a positive number of optimizer steps, or -1"),
        (["--max_steps", "0"], r"--max_steps 0: expected a positive number"),
        (["--max_steps", "-1", "--num_train_epochs", "0"], r"--num_train_epochs 0.0: expected a positive number"),
        (["--train_examples", "-3"], r"--train_examples -3: expected an integer >= 1"),
        (["--dev_examples", "-1"], r"--dev_examples -1: expected an integer >= 0"),
        (["--per_device_train_batch_size", "0"], r"--per_device_train_batch_size 0: expected an integer >= 1"),
        (["--gradient_accumulation_steps", "-2"], r"--gradient_accumulation_steps -2: expected an integer >= 1"),
        (["--learning_rate", "-0.001"], r"--learning_rate -0.001: expected a value >= 0"),
        (["--save_total_limit", "-1"], r"--save_total_limit -1: expected an integer >= 0"),
        (["--block_size", "1"], r"--block_size 1: expected an integer >= 2"),
        (["--mlm_probability", "1.5"], r"--mlm_probability 1.5: expected a rate between 0 and 1"),
    ],
)
def test_negative_and_zero_counts_are_refused_before_any_work(tmp_path, monkeypatch, flags, pattern):
    from plugformer.training.stages import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "stage_data", refuse_training)
    with pytest.raises(ValueError, match=pattern):
        pretrain(tmp_path / "run", *flags)
    assert not (tmp_path / "run").exists()


def test_trl_stages_refuse_negative_counts_before_loading_the_model(tmp_path, monkeypatch):
    from plugformer.training import common, run_stage

    monkeypatch.setattr(common, "load_model", refuse_training)
    for stage, flags in (
        ("sft", ["--max_steps", "-5"]),
        ("dpo", ["--max_length", "-1"]),
        ("grpo", ["--max_completion_length", "-8"]),
    ):
        with pytest.raises(ValueError, match=rf"--{flags[0][2:]} {flags[1]}: expected"):
            run_stage(stage, ["--output_dir", str(tmp_path / stage), "--model_name_or_path", str(tmp_path), *flags])


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (["--learning_rate", "inf"], r"--learning_rate inf: expected a finite number"),
        (["--learning_rate", "nan"], r"--learning_rate nan: expected a finite number"),
        (["--max_grad_norm", "nan"], r"--max_grad_norm nan: expected a finite number"),
        (["--weight_decay", "-1"], r"--weight_decay -1.0: expected a value >= 0"),
        (["--adam_beta2", "1.5"], r"--adam_beta2 1.5: expected a value in \[0, 1\]"),
        (["--direct_answer_fraction", "nan"], r"--direct_answer_fraction nan"),
    ],
)
def test_a_stage_refuses_non_finite_or_out_of_range_numbers_before_any_work(tmp_path, monkeypatch, flags, pattern):
    from plugformer.training.stages import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_work)
    with pytest.raises(ValueError, match=pattern):
        pretrain(tmp_path / "run", *flags)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("command", "flags", "pattern"),
    [
        ("demo", ["--learning_rate", "inf"], r"--learning_rate inf: expected a finite number"),
        ("extrapolate", ["--factors", "1", "inf"], r"factors.*inf"),
        ("extrapolate", ["--factors", "nan"], r"factors.*nan"),
    ],
)
def test_every_command_refuses_non_finite_numbers_in_one_line(tmp_path, capsys, command, flags, pattern):
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--output_dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert re.search(pattern, error) and "Traceback" not in error and error.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("entry", "field", "value", "pattern"),
    [
        ("pipeline", "test_examples", -1, r"--test_examples -1: expected an integer >= 0"),
        ("compare", "test_examples", 0, r"test_examples=0: expected at least 1"),
        ("compare", "dev_examples", 0, r"dev_examples=0: expected at least 1"),
        ("extrapolate", "test_examples", 0, r"test_examples=0: expected at least 1"),
    ],
)
def test_zero_test_examples_is_refused_where_a_test_split_is_needed(entry, field, value, pattern):
    from plugformer.experiments.compare import CompareArguments
    from plugformer.experiments.extrapolation import ExtrapolationArguments
    from plugformer.experiments.pipeline import PipelineArguments

    arguments = {"pipeline": PipelineArguments, "compare": CompareArguments, "extrapolate": ExtrapolationArguments}
    with pytest.raises(ValueError, match=pattern):
        arguments[entry](**{field: value})


def test_an_architecture_flag_beside_a_conflicting_override_is_refused(tmp_path, monkeypatch):
    from plugformer.training.stages import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_work)
    with pytest.raises(ValueError, match=r"--hidden_size 32 and --config_overrides hidden_size=64 contradict"):
        pretrain(tmp_path / "run", "--hidden_size", "32", "--config_overrides", "hidden_size=64")
