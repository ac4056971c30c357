"""`--resume_from_checkpoint` continues only the run it names: a checkpoint of another stage's run, a finished run that
saved no checkpoint, and a checkpoint of another model variant or size are refused before any work, naming both
sides, and leave the run as it was; the same variant continues."""

from __future__ import annotations

import pytest
from conftest import copy_run, refuse_work, snapshot
from conftest import pretrain_tiny as pretrain


def test_a_stage_resuming_in_another_stages_folder_is_refused(runs, tmp_path, monkeypatch):
    from test_training import TINY, TRL

    from plugformer.training import common, run_stage

    run = copy_run(runs, "checkpointed", tmp_path)
    before = snapshot(run)
    monkeypatch.setattr(common, "load_model", refuse_work)
    with pytest.raises(ValueError, match=r"holds a 'pretrain' run \(run_info.json\), not a 'sft' one"):
        run_stage(
            "sft",
            [
                "--model_name_or_path",
                str(run),
                "--output_dir",
                str(run),
                "--resume_from_checkpoint",
                "last",
                *TINY,
                *TRL,
            ],
        )
    with pytest.raises(ValueError, match=r"holds a 'pretrain' run"):  # an explicit checkpoint of another stage too
        run_stage(
            "sft",
            [
                "--model_name_or_path",
                str(run),
                "--output_dir",
                str(tmp_path / "sft"),
                "--resume_from_checkpoint",
                str(run / "checkpoint-2"),
                *TINY,
                *TRL,
            ],
        )
    assert snapshot(run) == before


def test_resuming_a_finished_run_without_checkpoints_does_not_retrain_it(runs, tmp_path, monkeypatch):
    from plugformer.training.stages import pretrain as pretrain_module

    run = copy_run(runs, "final_only", tmp_path)
    before = snapshot(run)
    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_work)
    with pytest.raises(ValueError, match=r"nothing to resume in .*'pretrain' run finished .* saved no checkpoint"):
        pretrain(run, "--resume_from_checkpoint", "last")
    assert snapshot(run) == before


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--attention_score", "additive"], "attention_score: 'scaled_dot' -> 'additive'"),
        (["--position_scheme", "alibi"], "position_scheme: 'rope' -> 'alibi'"),
        (["--hidden_size", "48"], "hidden_size: 32 -> 48"),  # a changed architecture: once an optimizer-group error
    ],
)
def test_resuming_with_another_variant_or_size_is_refused_naming_both_sides(runs, tmp_path, flags, named):
    from plugformer.training import checkpoints

    run = copy_run(runs, "checkpointed", tmp_path)
    weights = (run / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=rf"checkpoint-2 was trained with another model \(.*{named}"):
        pretrain(run, "--resume_from_checkpoint", "last", "--max_steps", "4", *flags)
    assert (run / "model.safetensors").read_bytes() == weights
    assert checkpoints.last_good_checkpoint(run).endswith("checkpoint-2")


def test_resuming_the_same_variant_still_continues(runs, tmp_path):
    run = copy_run(runs, "checkpointed", tmp_path)
    info = pretrain(run, "--resume_from_checkpoint", "last", "--max_steps", "3")
    assert info["stage"] == "pretrain" and (run / "checkpoint-2").is_dir()
