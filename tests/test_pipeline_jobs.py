"""`plugformer pipeline --jobs N` (N at most the cores available): stages start only after what they need, never more
than N cores busy, a stage that
is the only one able to run gets the idle cores, a failure stops new starts and names the stage; and on the
shipped configs the side-by-side run trains the weights the in-order run trains."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from conftest import micro_stage_configs
from safetensors.torch import load_file

from plugformer.experiments.parallel import Job, chain_work, estimated_work, run_jobs, split_batch
from plugformer.experiments.pipeline import PipelineArguments, requirements, stage_argv
from plugformer.runtime.arguments import override_flags
from plugformer.training import parse_stage_arguments


ROOT = Path(__file__).resolve().parents[1]


def sleeper(seconds: float, code: int = 0) -> list[str]:
    return [sys.executable, "-c", f"import time, sys; time.sleep({seconds}); print('slept'); sys.exit({code})"]


def test_the_pipelines_requirements():
    needs = requirements(PipelineArguments(stages=["pretrain", "sft", "reward", "rlhf", "dpo", "grpo"]))
    assert needs == {
        "pretrain": set(),
        "sft": {"pretrain"},
        "reward": {"sft"},
        "rlhf": {"sft", "reward"},
        "dpo": {"sft"},
        "grpo": {"sft"},
    }


@pytest.mark.parametrize(
    ("stage", "batch", "free", "processes"),
    [("pretrain", 32, 2, 2), ("sft", 32, 4, 4), ("sft", 6, 4, 3), ("dpo", 7, 2, 1), ("grpo", 64, 2, 1),
     ("rlhf", 64, 2, 1), ("reward", 32, 1, 1)],
)  # fmt: skip
def test_only_example_batches_are_split_and_only_evenly(stage, batch, free, processes):
    assert split_batch(stage, batch, free) == processes


def test_jobs_start_after_their_needs_and_never_exceed_the_cores(tmp_path):
    # the pipeline's shape: a chain, then three branches, one of them two long
    needs = {"a": set(), "b": {"a"}, "c": {"b"}, "d": {"c", "b"}, "e": {"b"}, "f": {"b"}}
    offered = {}

    def make_job(stage: str, free: int) -> Job:
        offered[stage] = free
        return Job(stage, [sleeper(0.4)], processes=free if stage in "ab" else 1)

    done = run_jobs(make_job, needs, jobs=2, log_dir=tmp_path, poll_seconds=0.02)
    assert set(done) == set(needs) and all(job.returncode == 0 for job in done.values())
    assert offered == {"a": 2, "b": 2, "c": 1, "d": 1, "e": 1, "f": 1}  # alone: every idle core; else one
    for stage, job in done.items():
        assert all(done[need].finished <= job.started for need in needs[stage])
    moments = sorted({job.started for job in done.values()})
    for moment in moments:  # cores busy at each start
        busy = sum(job.processes for job in done.values() if job.started <= moment < job.finished)
        assert busy <= 2
    assert max(sum(1 for j in done.values() if j.started <= m < j.finished) for m in moments) == 2  # side by side
    assert "slept" in (tmp_path / "d.log").read_text()


def test_the_task_heading_the_most_work_starts_first(tmp_path):
    """After b three branches are ready on two cores: e (its own work 1, then f's 10) and d (5) start before c (2),
    whatever `needs`'s order; without `work`, `needs`'s order."""
    needs = {"a": set(), "b": {"a"}, "c": {"b"}, "d": {"b"}, "e": {"b"}, "f": {"e"}}
    work = {"a": 1, "b": 1, "c": 2, "d": 5, "e": 1, "f": 10}
    assert chain_work(needs, work) == {"a": 13, "b": 12, "c": 2, "d": 5, "e": 11, "f": 10}

    def make_job(stage: str, free: int) -> Job:
        return Job(stage, [sleeper(0.3)])

    def run(**options) -> dict:
        return run_jobs(make_job, needs, jobs=2, log_dir=tmp_path, poll_seconds=0.02, **options)

    done = run(work=work)
    assert done["c"].started >= min(done["d"].finished, done["e"].finished)
    assert max(done["d"].started, done["e"].started) < done["c"].started
    done = run()
    assert max(done["c"].started, done["d"].started) < done["e"].started


def test_on_the_shipped_configs_the_longest_branch_after_sft_starts_first():
    """Each stage's work is its steps x batch from its YAML; after sft, grpo (25 x 256) heads more than dpo -> rlhf
    (25 x 32 + 25 x 64), which heads more than reward (40 x 32); a grpo of 2 steps would start last."""
    args = PipelineArguments(stages=["pretrain", "sft", "reward", "dpo", "rlhf", "grpo"], rlhf_reward="dpo")
    work = {}
    for stage in args.stages:
        script_args, _, training_args = parse_stage_arguments(stage, stage_argv(args, stage))
        work[stage] = estimated_work(script_args, training_args)
    assert {stage: work[stage] for stage in ("reward", "dpo", "rlhf", "grpo")} == {
        "reward": 40 * 32,
        "dpo": 25 * 32,
        "rlhf": 25 * 64,
        "grpo": 25 * 256,
    }
    ahead = chain_work(requirements(args), work)
    branches = sorted(["reward", "dpo", "rlhf", "grpo"], key=lambda stage: -ahead[stage])
    assert branches == ["grpo", "dpo", "rlhf", "reward"] and ahead["dpo"] == 25 * 32 + 25 * 64
    ahead = chain_work(requirements(args), {**work, "grpo": 2 * 256})
    assert min(["reward", "dpo", "grpo"], key=lambda stage: ahead[stage]) == "grpo"


def test_tasks_outside_spread_wait_for_a_free_core_instead_of_splitting_one(tmp_path):
    """The pipeline's test scores: ready beside the next stage, they neither take its second core nor run first."""
    needs = {"a": set(), "b": {"a"}, "a.test": {"a"}, "b.test": {"b"}}
    offered = {}

    def make_job(task: str, free: int) -> Job:
        offered[task] = free
        return Job(task, [sleeper(0.3)], processes=free)

    done = run_jobs(make_job, needs, jobs=2, log_dir=tmp_path, poll_seconds=0.02, spread={"a", "b"})
    assert offered == {"a": 2, "b": 2, "a.test": 1, "b.test": 1}
    assert done["a.test"].started >= done["b"].finished  # b held both cores
    assert done["a.test"].started < done["b.test"].finished and done["b.test"].started < done["a.test"].finished


def test_a_failed_job_stops_new_starts_lets_running_ones_finish_and_names_itself(tmp_path):
    needs = {"a": set(), "b": {"a"}, "c": {"a"}, "d": {"b"}}
    trained = []

    def make_job(stage: str, free: int) -> Job:
        command = sleeper(0.1, code=3) if stage == "b" else sleeper(0.6)
        return Job(stage, [command, sleeper(0.05)], on_trained=lambda: trained.append(stage))

    with pytest.raises(RuntimeError) as raised:
        run_jobs(make_job, needs, jobs=2, log_dir=tmp_path, poll_seconds=0.02)
    message = str(raised.value)
    assert "['b'] failed" in message and "not started: ['d']" in message and "slept" in message
    assert trained == ["a", "c"]  # c, running beside the failure, finished and was recorded; b never was
    assert (tmp_path / "c.log").read_text().count("\nslept\n") == 2  # both of c's commands ran


def test_an_error_in_the_pipeline_itself_stops_the_running_jobs(tmp_path):
    needs = {"a": set(), "b": set(), "c": {"a"}}
    made = {}

    def make_job(stage: str, free: int) -> Job:
        if stage == "c":
            raise ValueError("stage 'c': a bad YAML")
        made[stage] = Job(stage, [sleeper(0.2 if stage == "a" else 60)])
        return made[stage]

    with pytest.raises(ValueError, match="a bad YAML"):
        run_jobs(make_job, needs, jobs=2, log_dir=tmp_path, poll_seconds=0.02)
    assert made["b"].process.returncode == -signal.SIGTERM  # stopped, not left running for a minute


def test_jobs_must_be_a_positive_integer():
    with pytest.raises(ValueError, match=r"--jobs 0: expected an integer >= 1"):
        PipelineArguments(jobs=0)


def test_side_by_side_pipeline_trains_what_the_in_order_pipeline_trains(tmp_path, capsys):
    """pretrain and sft, each alone, train on 2 processes with half the per-device batch: the same effective batch,
    the same weights (to float rounding) and the same held-out table as one process."""
    from plugformer.experiments.pipeline import main as pipeline_main

    configs = micro_stage_configs(tmp_path)
    common = [
        "--config",
        str(ROOT / "configs/pipeline/tiny.yaml"),
        "--stage_configs",
        configs,
        "--stages",
        "pretrain",
        "sft",
        "--test_examples",
        "6",
        "--max_new_tokens",
        "6",
    ]
    in_order = pipeline_main([*common, "--output_dir", str(tmp_path / "one"), "--jobs", "1"])
    side = pipeline_main([*common, "--output_dir", str(tmp_path / "two"), "--jobs", "2"])
    for stage in ("pretrain", "sft"):
        one, two = (load_file(str(tmp_path / run / stage / "model.safetensors")) for run in ("one", "two"))
        assert max((one[name] - two[name]).abs().max().item() for name in one) < 1e-6, stage
        batches = [
            json.loads((tmp_path / run / stage / "run_info.json").read_text())["effective_batch"]
            for run in ("one", "two")
        ]
        assert [b["world_size"] for b in batches] == [1, 2] and batches[0]["total"] == batches[1]["total"] == 8
        assert side[stage]["processes"] == 2 and "processes" not in in_order[stage]
        assert side[stage]["correct"] == in_order[stage]["correct"]
    assert "trained on 2 processes" in (tmp_path / "two/results.md").read_text()
    assert (tmp_path / "two/logs/sft.log").is_file() and (tmp_path / "two/logs/sft.test.log").is_file()
    capsys.readouterr()
    # unchanged: reused (the test split is not part of a stage's record; without it no scoring process starts)
    rerun = override_flags(common, ["--output_dir", str(tmp_path / "two"), "--jobs", "2", "--test_examples", "0"])
    pipeline_main(rerun)
    assert capsys.readouterr().out.count("reusing") == 2


def test_pipeline_jobs_is_capped_at_the_cores_available():
    from plugformer.experiments.pipeline import PipelineArguments, available_cores

    with pytest.raises(ValueError, match=rf"--jobs 1000: this machine lets plugformer use {available_cores()} CPU"):
        PipelineArguments(jobs=1000)
    assert PipelineArguments(jobs=available_cores()).jobs == available_cores()
