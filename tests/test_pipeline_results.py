"""What `plugformer pipeline` reports: under `--test_examples 0` no held-out scores, said so at the head of results.md,
and the run's wall time recorded beside the machine's matmul rate, measured before and after the run."""

from __future__ import annotations

from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
CONFIGS = str(ROOT / "configs" / "{stage}" / "tiny.yaml")


def test_pipeline_with_test_examples_0_reports_no_test_scores(finished, tmp_path, capsys):
    """`plugformer pipeline --test_examples 0` ended in KeyError: 'test' after the stage had trained."""
    import json
    import shutil

    import torch

    from plugformer.experiments import pipeline
    from plugformer.runtime.files import write_json_atomic

    args = pipeline.PipelineArguments(
        output_dir=str(tmp_path / "pipeline"),
        stages=["pretrain"],
        test_examples=0,
        stage_configs=CONFIGS,
        max_new_tokens=4,
    )
    shutil.copytree(finished, tmp_path / "pipeline" / "pretrain")  # a finished stage, recorded as this one: reused
    argv = pipeline.stage_argv(args, "pretrain")
    record = pipeline.finished_record(args, "pretrain", pipeline.stage_record(args, "pretrain", argv))
    write_json_atomic(tmp_path / "pipeline" / "pretrain" / pipeline.RECORD, record)
    results = pipeline.run(args)
    assert "reusing" in capsys.readouterr().out
    assert "exact_match" not in results["pretrain"] and results["pretrain"]["gain"] is None
    table = (tmp_path / "pipeline" / "results.md").read_text()
    assert table.startswith("no held-out test scores (--test_examples 0)") and "| pretrain | — |" in table
    assert json.loads((tmp_path / "pipeline" / "results.json").read_text())["pretrain"]["train_seconds"] >= 0
    # the wall time is recorded beside the machine's matmul rate, without which it compares with nothing
    run = json.loads((tmp_path / "pipeline" / pipeline.RUN_RECORD).read_text())
    assert run["wall_seconds"] >= 0 and run["jobs"] == 1 and run["machine"]["matmul_gflops"] > 0
    assert run["machine"]["threads"] == torch.get_num_threads()
    # measured before and after the run, the mean of the two in front
    before, after = run["machine"]["matmul_gflops_before"], run["machine"]["matmul_gflops_after"]
    assert before > 0 and after > 0 and run["machine"]["matmul_gflops"] == pytest.approx((before + after) / 2, abs=0.06)
