"""The alignment stages' contracts: the worked-arithmetic task, pass@k, dev selection of the best step, the gain
table and the over-optimisation plot. Numbers are checked against independent computations; no accuracy or
timing thresholds (the recorded 3-seed runs in model_cards/pipeline-tiny/RESULTS.md show those)."""

from __future__ import annotations

import itertools
import json
import random
import re
import statistics
from pathlib import Path

import pytest
import torch

from plugformer.data import sources as task
from plugformer.evaluation import language_scores as evaluation
from plugformer.evaluation.rewards import exact_match_reward, format_reward
from plugformer.training import selection
from plugformer.training.arguments import StageArguments


# one-digit operands, then an optional carry or borrow and an optional +10, then the value; a multiplication with a
# carry writes its product before adding the carry (`4*6=24+4=28`)
STEP = re.compile(r"\A\d[+*-]\d(?:=\d+)?(?:[+-]\d)?(?:\+10)?=\d+\Z")


def check_step(step: str) -> int:
    """A step is `d op d [=product] [carry] [+10] = value`; each `=` joins a left side to its arithmetic."""
    assert STEP.match(step), step
    *lefts, value = step.split("=")
    running = eval(lefts[0], {"__builtins__": {}})  # digits and + - * only (checked above)
    for left in lefts[1:]:  # `24+4`: the number before the carry is the product just written
        head, _, tail = left.partition("+")
        assert int(head) == running and tail, step
        running = eval(left, {"__builtins__": {}})
    assert running == int(value), step
    return int(value)


@pytest.mark.parametrize("operation", ["add", "sub", "mul"])
def test_worked_steps_are_one_digit_facts_that_add_up_to_the_answer(operation):
    rng = random.Random(operation)
    for _ in range(2000):
        a = rng.randrange(1000)
        b = rng.randrange(10) if operation == "mul" else rng.randrange(1000)
        if operation == "sub" and b > a:
            a, b = b, a
        steps = task.worked_steps(operation, a, b)
        values = [check_step(step) for step in steps]
        assert len(steps) == max(len(str(a)), 1 if operation == "mul" else len(str(b)))
        # column arithmetic read back: the last step whole, the others' units digits (independent of the module)
        expected = {"add": a + b, "sub": a - b, "mul": a * b}[operation]
        digits = str(values[-1]) + "".join(str(v % 10) for v in reversed(values[:-1]))
        assert int(digits) == expected and task.answer_from_steps(operation, steps) == expected


def test_solutions_are_formatted_and_wrong_answers_are_wrong_in_the_same_format():
    rng = random.Random(0)
    problems = task.generate_problems(600, "train")
    solutions = [p.solution for p in problems]
    assert format_reward(solutions) == [1.0] * len(problems)
    assert exact_match_reward(solutions, answer=[str(p.answer) for p in problems]) == [1.0] * len(problems)
    wrong = [task.wrong_answer(p, rng) for p in problems]
    assert format_reward(wrong) == [1.0] * len(problems)
    assert exact_match_reward(wrong, answer=[str(p.answer) for p in problems]) == [0.0] * len(problems)
    # right and wrong answers restate the problem alike (`347 + 85: `), so only the arithmetic tells them apart
    symbols = {"add": "+", "sub": "-", "mul": "*"}
    for problem, right, slipped in zip(problems, solutions, wrong, strict=True):
        restated = f"{problem.a} {symbols[problem.operation]} {problem.b}: "
        assert right.startswith(restated) and slipped.startswith(restated)
    # short and long problems both occur, for every operation
    widths = {(p.operation, len(str(p.a))) for p in problems}
    assert widths == {(op, w) for op in ("add", "sub", "mul") for w in (1, 2, 3)}


def test_direct_answer_fraction_mixes_bare_answers_into_demonstrations_and_rejected_answers():
    """SFT answers skip the working at the given rate (binomial 95% band over 2000 rows), a bare answer is right,
    every rejected answer stays wrong, and fraction 0 gives the data of the all-worked task row for row."""
    sizes = {"train": 2000}
    sft = task.embedded_dataset("conversation", sizes, direct_fraction=0.6)["train"]
    answers = [row["completion"][0]["content"] for row in sft]
    bare = [a for a in answers if "\n" not in a]
    assert abs(len(bare) / 2000 - 0.6) < 1.96 * (0.6 * 0.4 / 2000) ** 0.5 * 1.5
    problems = task.generate_problems(2000, "train")
    expected = [p.direct if "\n" not in a else p.solution for p, a in zip(problems, answers, strict=True)]
    assert answers == expected and all(re.fullmatch(r"#### \d+", a) for a in bare)
    pairs = task.embedded_dataset("preference", sizes, direct_fraction=0.6)["train"]
    rejected = [row["rejected"][0]["content"] for row in pairs]
    assert exact_match_reward(rejected, answer=[str(p.answer) for p in problems]) == [0.0] * 2000
    assert 0.5 < sum("\n" not in r for r in rejected) / 2000 < 0.7
    assert [row["chosen"][0]["content"] for row in pairs] == [p.solution for p in problems]
    plain = task.embedded_dataset("conversation", sizes)["train"]
    assert list(plain) == list(task.embedded_dataset("conversation", sizes, direct_fraction=0.0)["train"])
    assert [row["completion"][0]["content"] for row in plain] == [p.solution for p in problems]
    with pytest.raises(ValueError, match=r"direct_answer_fraction=1\.5"):
        task.embedded_dataset("conversation", sizes, direct_fraction=1.5)
    with pytest.raises(ValueError, match=r"--direct_answer_fraction -0.1: expected a number in \[0, 1\]"):
        StageArguments(direct_answer_fraction=-0.1)


def test_held_out_problems_share_no_fact_with_training():
    facts = {split: {(p.operation, p.a, p.b) for p in task.generate_problems(4000, split)} for split in task.SPLITS}
    assert not facts["train"] & facts["test"] and not facts["train"] & facts["dev"] and not facts["dev"] & facts["test"]


@pytest.mark.parametrize(
    ("samples", "correct", "k"), [(8, 0, 1), (8, 3, 1), (8, 3, 2), (8, 5, 4), (6, 1, 6), (5, 2, 3)]
)
def test_pass_at_k_equals_counting_every_subset(samples, correct, k):
    draws = [1] * correct + [0] * (samples - correct)
    subsets = list(itertools.combinations(draws, k))
    assert evaluation.pass_at_k(samples, correct, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="correct"):
        evaluation.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k"):
        evaluation.pass_at_k(4, 1, 5)


def test_sampled_pass_at_k_on_a_fixed_set(monkeypatch):
    # prompt 0: 2 of 4 samples right, prompt 1: none, prompt 2: all four
    completions = ["#### 3", "#### 4", "#### 3", "x", "#### 1", "#### 1", "#### 1", "#### 1"] + ["#### 9"] * 4
    monkeypatch.setattr(evaluation, "generate_answers", lambda *args, **kwargs: completions)
    rows = {"prompt": ["a", "b", "c"], "answer": ["3", "2", "9"]}
    result = evaluation.sampled_pass_at_k(None, None, rows, samples=4, ks=(1, 2, 4))
    assert result["pass@1"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert result["pass@2"] == pytest.approx((1 - 1 / 6 + 0 + 1) / 3)  # C(2,2)/C(4,2) = 1/6 pairs miss prompt 0
    assert result["pass@4"] == pytest.approx(2 / 3)


class Step:
    def __init__(self, step: int):
        self.global_step = step


def test_dev_selection_hands_on_the_best_step_not_the_last(monkeypatch):
    """Scores are scripted per step; the weights left in the model at the end are those of the best step."""
    scores = {0: 0.20, 2: 0.35, 4: 0.50, 6: 0.50, 8: 0.40}  # a tie at 6 keeps the earlier step 4
    model = torch.nn.Linear(3, 2)
    monkeypatch.setattr(
        selection, "exact_match", lambda m, t, rows, n, synced_gpus: {"exact_match": scores[current[0]], "format": 1.0}
    )
    current = [0]
    callback = selection.DevSelection(rows=None, tokenizer=None, every=2)
    snapshots = {}
    callback.on_train_begin(None, Step(0), None, model=model)
    snapshots[0] = model.weight.detach().clone()
    for step in range(1, 9):
        with torch.no_grad():
            model.weight.add_(1.0)  # an optimiser step
        current[0] = step
        callback.on_step_end(None, Step(step), None, model=model)
        callback.on_log(None, Step(step), None, logs={"reward": str(step / 10), "kl": step / 100, "loss": 1.0})
        snapshots[step] = model.weight.detach().clone()
    callback.on_train_end(None, Step(8), None, model=model)
    assert torch.equal(model.weight, snapshots[4])
    summary = callback.summary()
    assert summary["selected"]["step"] == 4 and summary["last"]["step"] == 8
    assert [e["step"] for e in summary["history"]] == [0, 2, 4, 6, 8]
    assert summary["history"][2] == {"step": 4, "dev_exact_match": 0.5, "dev_format": 1.0, "reward": 0.4, "kl": 0.04}
    assert "reward" not in summary["history"][0]  # nothing is logged before the first step


def test_dev_selection_scores_the_last_step_and_refuses_a_bad_interval(monkeypatch):
    monkeypatch.setattr(selection, "exact_match", lambda *a, **k: {"exact_match": 0.1, "format": 1.0})
    model = torch.nn.Linear(2, 2)
    callback = selection.DevSelection(rows=None, tokenizer=None, every=5)
    callback.on_train_begin(None, Step(0), None, model=model)
    callback.on_train_end(None, Step(3), None, model=model)
    assert [e["step"] for e in callback.summary()["history"]] == [0, 3]
    assert callback.summary()["selected"]["step"] == 0  # no step beat the start: the start is handed on
    with pytest.raises(ValueError, match="selection_steps"):
        selection.DevSelection(rows=None, tokenizer=None, every=0)


def test_overoptimisation_plot_is_written(tmp_path):
    history = [{"step": 0, "dev_exact_match": 0.3}] + [
        {"step": s, "dev_exact_match": 0.3 + s / 100, "reward": s / 10, "kl": s / 50} for s in (5, 10, 15)
    ]
    path = selection.plot_overoptimisation(history, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert selection.plot_overoptimisation(history[:2], tmp_path / "none.png") is None


def test_overoptimisation_plot_starts_the_gold_curve_at_the_reference(tmp_path, monkeypatch):
    """The gold (dev exact match) line begins at the start's score, at step 0 and at KL 0; the proxy has no
    point there (no reward is logged before training)."""
    from plugformer.evaluation import figures

    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path, dpi: drawn.append(fig) or path)
    history = [{"step": 0, "dev_exact_match": 0.1}] + [
        {"step": s, "dev_exact_match": 0.2, "reward": s / 10, "kl": s / 50} for s in (25, 50)
    ]
    selection.plot_overoptimisation(history, tmp_path / "curve.png")
    assert len(drawn[0].axes) == 4
    gold = [axis.get_lines()[0] for axis in drawn[0].axes if axis.get_ylabel() == "dev exact match (%)"]
    assert [list(line.get_xdata()) for line in gold] == [[0.0, 25, 50], [0.0, 0.5, 1.0]]
    assert all(list(line.get_ydata()) == [10.0, 20.0, 20.0] for line in gold)
    proxies = [axis.get_lines()[0] for axis in drawn[0].axes if axis.get_ylabel() == "reward model score"]
    assert [list(line.get_xdata()) for line in proxies] == [[25, 50], [0.5, 1.0]]


def test_gain_over_parent_is_the_paired_bootstrap_of_per_problem_scores():
    from plugformer.evaluation.stats import paired_bootstrap
    from plugformer.experiments.pipeline import gain_over_parent, gain_text

    results = {"sft": {"correct": [1, 0, 0, 1, 0, 0]}, "grpo": {"correct": [1, 1, 0, 1, 1, 0]}, "reward": {}}
    gain = gain_over_parent(results, "grpo")
    assert gain == paired_bootstrap([1, 1, 0, 1, 1, 0], [1, 0, 0, 1, 0, 0]).to_dict()
    assert gain["difference"] == pytest.approx(2 / 6)
    assert gain_text(gain).startswith("+33.3 (")
    assert gain_over_parent(results, "reward") is None and gain_text(None) == "—"
    json.dumps(gain)  # goes into results.json
    # scores of other examples (classify's sentences against pretraining's problems) are never paired
    other = {
        "pretrain": {"correct": [0, 1, 0], "data_sha256": "a"},
        "classify": {"correct": [1, 1, 1], "data_sha256": "b"},
    }
    assert gain_over_parent(other, "classify") is None
    from plugformer.experiments.pipeline import other_text  # the table shows a classifier's own scores

    assert other_text({"accuracy": 0.9, "macro_f1": 0.875, "examples": 150}).startswith(
        "accuracy 90.0%, macro F1 0.875"
    )


def pipeline_args(tmp_path, **overrides):
    from plugformer.experiments.pipeline import PipelineArguments

    configs = tmp_path / "configs"
    configs.mkdir(exist_ok=True)
    for stage in ("pretrain", "sft", "reward", "rlhf", "dpo", "grpo"):
        (configs / f"{stage}.yaml").write_text("max_steps: 2\n")
    return PipelineArguments(output_dir=str(tmp_path / "out"), stage_configs=str(configs / "{stage}.yaml"), **overrides)


def finish(args, stage, digests=(1,)):
    """A stage folder as the pipeline leaves a finished stage: run_info.json and the record of what shaped it."""
    from plugformer.experiments.pipeline import RECORD, finished_record, stage_argv, stage_record

    folder = Path(args.output_dir, stage)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run_info.json").write_text(json.dumps({"parameter_digests": list(digests)}))
    (folder / "model.safetensors").write_bytes(f"weights {digests}".encode())
    record = finished_record(args, stage, stage_record(args, stage, stage_argv(args, stage)))
    (folder / RECORD).write_text(json.dumps(record))


def test_a_finished_stage_whose_weights_were_replaced_is_not_reused(tmp_path):
    """The recorded digests were never compared with the folder's weights, so a stage whose weights were
    replaced after training was reused (and scored, and trained on) as if it were the trained model."""
    from plugformer.experiments.pipeline import RECORD, plan_stage, stage_argv, stage_record

    args = pipeline_args(tmp_path)
    finish(args, "pretrain")
    record = stage_record(args, "pretrain", stage_argv(args, "pretrain"))
    assert plan_stage(args, "pretrain", record) is None
    trained = json.loads((tmp_path / "out/pretrain" / RECORD).read_text())["weights_sha256"]
    (tmp_path / "out/pretrain/model.safetensors").write_bytes(b"other weights")
    with pytest.raises(
        ValueError,
        match=rf"stage 'pretrain': .*pretrain now holds weights sha256 \w{{12}}, but the "
        rf"stage saved weights sha256 {trained[:12]}",
    ):
        plan_stage(args, "pretrain", record)
    assert plan_stage(pipeline_args(tmp_path, rerun=True), "pretrain", record)[0] == "--rerun true"
    (tmp_path / "out/pretrain" / RECORD).write_text(json.dumps(record))  # a record without the weights' digest
    assert "records no weights sha256" in plan_stage(args, "pretrain", record)[0]


def test_a_finished_stage_is_reused_only_while_its_yaml_seeds_and_parents_are_unchanged(tmp_path):
    from plugformer.experiments.pipeline import plan_stage, stage_argv, stage_record

    args = pipeline_args(tmp_path)

    def plan(stage, run_args=args):
        return plan_stage(run_args, stage, stage_record(run_args, stage, stage_argv(run_args, stage)))

    finish(args, "pretrain")
    finish(args, "sft")
    assert plan("pretrain") is None and plan("sft") is None
    why, flags = plan("sft", pipeline_args(tmp_path, seed=7))  # another seed: the argv differs
    assert "argv changed" in why and flags == ["--overwrite_output_dir", "true"]
    (tmp_path / "configs/sft.yaml").write_text("max_steps: 3\n")
    assert "config_sha256 changed" in plan("sft")[0]
    finish(args, "sft")
    finish(args, "pretrain", digests=(2,))  # the parent retrained: other weights
    assert "parent_digests changed" in plan("sft")[0]
    (tmp_path / "out/sft/pipeline_stage.json").unlink()
    assert "pipeline_stage.json is missing" in plan("sft")[0]
    assert plan("pretrain", pipeline_args(tmp_path, rerun=True)) == ("--rerun true", ["--overwrite_output_dir", "true"])


def test_an_interrupted_stage_resumes_and_a_foreign_unfinished_folder_is_replaced(tmp_path):
    from plugformer.experiments.pipeline import RECORD, plan_stage, stage_argv, stage_record

    args = pipeline_args(tmp_path)
    folder = tmp_path / "out/pretrain"
    (folder / "checkpoint-4").mkdir(parents=True)
    record = stage_record(args, "pretrain", stage_argv(args, "pretrain"))
    assert plan_stage(args, "pretrain", record)[1] == ["--overwrite_output_dir", "true"]  # no record: not ours
    (folder / RECORD).write_text(json.dumps(record))
    assert plan_stage(args, "pretrain", record)[1] == ["--resume_from_checkpoint", "last"]
    assert plan_stage(args, "sft", stage_record(args, "sft", stage_argv(args, "sft"))) == ("training", [])


def test_a_typo_in_the_last_stage_yaml_fails_before_the_first_stage_trains(tmp_path, monkeypatch):
    from plugformer.experiments import pipeline

    args = pipeline_args(tmp_path)
    (tmp_path / "configs/grpo.yaml").write_text("learnig_rate: 0.1\n")
    trained = []
    monkeypatch.setattr(pipeline, "run_stage", lambda stage, argv: trained.append(stage))
    with pytest.raises(ValueError, match=r"stage 'grpo' .*grpo\.yaml.*learnig_rate"):
        pipeline.run(args)
    assert trained == []


@pytest.mark.parametrize("stage", ["grpo", "rlhf"])
def test_zero_generations_per_prompt_is_a_value_error(stage):
    from plugformer.training import parse_stage_arguments

    with pytest.raises(ValueError, match="num_generations must be at least 2"):
        parse_stage_arguments(stage, ["--output_dir", "unused", "--num_generations", "0"])


@pytest.mark.parametrize("config", ["configs/grpo/tiny.yaml", "configs/grpo/gpu.yaml"])
def test_grpo_reward_weights_give_groups_of_equal_rewards_exactly_zero_std(config):
    """TRL counts a group as uninformative (`frac_reward_zero_std`) with `isclose(std, 0)` on float32 weighted
    sums; a weight like 0.2 rounds so that eight equal rewards have std ~1e-8 and the metric read 0 at every step."""
    import yaml
    from trl.trainer.utils import nanstd

    weights = torch.tensor(yaml.safe_load(Path(config).read_text())["reward_weights"], dtype=torch.float32)
    for scores in itertools.product([0.0, 1.0], repeat=len(weights)):  # every row of reward-function outputs
        group = torch.tensor([scores] * 8, dtype=torch.float32)
        rewards = (group * weights[None]).nansum(dim=1)  # as GRPOTrainer sums them
        assert torch.isclose(nanstd(rewards), torch.zeros(())), (scores, nanstd(rewards).item())


def test_seed_table_over_pipeline_runs(tmp_path):
    """`plugformer seeds`: means and t intervals over runs, the paired t-test of the gains, and the per-run bootstrap
    figures as the pipeline wrote them, checked against scipy's own t distribution and paired test."""
    from scipy import stats as scipy_stats

    from plugformer.experiments import seeds

    sft, grpo = [0.10, 0.14, 0.12], [0.40, 0.38, 0.45]
    directories = []
    for index, (before, after) in enumerate(zip(sft, grpo, strict=True)):
        run = {
            "pretrain": {
                "train_seconds": 100.0,
                "exact_match": 0.01,
                "gain": None,
                "pretraining_format": {"exact_match": 0.93 + index / 100},
            },
            "sft": {
                "train_seconds": 50.0 + index,
                "exact_match": before,
                "gain": {"difference": before - 0.01, "p_value": 1e-4},
            },
            "reward": {"train_seconds": 30.0, "pairwise_accuracy": 0.8 + index / 100, "gain": None},
            "dpo": {
                "train_seconds": 40.0,
                "exact_match": after,
                "implicit_reward_pairwise_accuracy": 0.86 + index / 50,
                "gain": {"difference": after - before, "p_value": 1e-4},
            },
            "grpo": {
                "train_seconds": 60.0,
                "exact_match": after,
                "gain": {"difference": after - before, "p_value": 0.001 * (index + 1)},
            },
        }
        directory = tmp_path / f"seed{index}"
        directory.mkdir()
        (directory / "results.json").write_text(json.dumps(run))
        if index < 2:  # the third run predates pipeline_run.json: left out of the wall-time line
            record = {"wall_seconds": 300.4 + index, "machine": {"matmul_gflops": 150.0 + index, "threads": 1}}
            (directory / "pipeline_run.json").write_text(json.dumps(record))
        directories.append(str(directory))
    table = seeds.main([*directories, "--output", str(tmp_path / "seeds.md")])
    assert (tmp_path / "seeds.md").read_text() == table + "\n"
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    half = scipy_stats.t.ppf(0.975, 2) * statistics.stdev(grpo) / 3**0.5
    mean = statistics.mean(grpo)
    assert f"{mean * 100:.1f} ({(mean - half) * 100:.1f}, {(mean + half) * 100:.1f})" in rows["grpo"]
    gains = [a - b for a, b in zip(grpo, sft, strict=True)]
    gain_half = scipy_stats.t.ppf(0.975, 2) * statistics.stdev(gains) / 3**0.5
    p = scipy_stats.ttest_rel(grpo, sft).pvalue
    expected = f"{statistics.mean(gains) * 100:+.1f} ({(statistics.mean(gains) - gain_half) * 100:+.1f}, "
    assert expected in rows["grpo"] and f"p {p:.2g}" in rows["grpo"]
    assert "+30.0 (p 0.001), +24.0 (p 0.002), +33.0 (p 0.003)" in rows["grpo"]
    assert "pairwise accuracy 81.0" in rows["reward"] and rows["sft"].endswith("| 51 |")
    implicit = [0.86, 0.88, 0.90]
    implicit_half = scipy_stats.t.ppf(0.975, 2) * statistics.stdev(implicit) / 3**0.5
    assert f"; implicit reward pairwise accuracy 88.0 ({(0.88 - implicit_half) * 100:.1f}, " in rows["dpo"]
    # the pretrained model asked as its corpus asks: 93, 94, 95% (s = 1 point)
    asked_half = scipy_stats.t.ppf(0.975, 2) * 0.01 / 3**0.5
    assert f"| 1.0 (1.0, 1.0); asked as in pretraining 94.0 ({(0.94 - asked_half) * 100:.1f}, " in rows["pretrain"]
    assert "asked as in pretraining" not in rows["sft"]
    assert table.endswith(
        "wall time per run (torch.mm rate of the machine): seed0 300 s (150 GFLOP/s), seed1 301 s (151 GFLOP/s)"
    )
    with pytest.raises(ValueError, match=r"no results\.json"):
        seeds.main([str(tmp_path)])


def test_dev_selection_keeps_the_last_step_for_a_dpo_reward(monkeypatch, tmp_path):
    """`keep_last`: the selected step is handed on and the last step's weights are written beside it, in last_step/
    (the dpo stage's implicit reward reads them); nothing is written when the last step is the selected one."""
    from conftest import build, tiny_config
    from transformers import AutoModelForCausalLM

    scores = iter([0.5, 0.2, 0.1])  # the start is the best
    monkeypatch.setattr(selection, "exact_match", lambda *a, **k: {"exact_match": next(scores), "format": 1.0})
    model = build(tiny_config(), seed=0)
    tokenizer = type("Tokenizer", (), {"save_pretrained": lambda self, path: None})()
    callback = selection.DevSelection(rows=None, tokenizer=None, every=2, keep_last=True)
    callback.on_train_begin(None, Step(0), None, model=model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in (2, 4):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * step)
        callback.on_step_end(None, Step(step), None, model=model)
    last = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback.on_train_end(None, Step(4), None, model=model)
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())  # step 0 handed on
    model.save_pretrained(tmp_path)  # what the stage saves: the selected model
    trainer = type(
        "Trainer",
        (),
        {
            "is_world_process_zero": lambda self: True,
            "accelerator": type("A", (), {"wait_for_everyone": lambda self: None})(),
        },
    )()
    assert selection.save_last_step(trainer, tokenizer, callback, str(tmp_path)) == "last_step"
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "last_step")
    assert all(torch.equal(p, last[n]) for n, p in saved.named_parameters())
    assert any(not torch.equal(last[n], start[n]) for n in start)
    # the last step selected: nothing kept, nothing written
    scores = iter([0.1, 0.5])
    again = selection.DevSelection(rows=None, tokenizer=None, every=2, keep_last=True)
    again.on_train_begin(None, Step(0), None, model=model)
    again.on_train_end(None, Step(2), None, model=model)
    assert (
        again.last_weights is None and selection.save_last_step(trainer, tokenizer, again, str(tmp_path / "b")) is None
    )
