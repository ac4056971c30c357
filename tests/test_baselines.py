"""The baselines: rejection-sampling fine-tuning (rft) and compute-matched SFT (sft_matched), the compute each
stage records, and the gains against the baselines in the pipeline's and `plugformer seeds`' tables.

Contracts, not accuracy: which samples rft keeps, the token budget and step arithmetic, the paired statistics
against hand-computed values, and the pipeline's chaining of the new stages (a micro run, the verifier stubbed).
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import micro_stage_configs

from plugformer.evaluation.answers import generated_lengths
from plugformer.evaluation.stats import paired_bootstrap
from plugformer.experiments import baselines, seeds
from plugformer.experiments.pipeline import PipelineArguments, stage_argv
from plugformer.training import STAGES
from plugformer.training.stages import rft, sft_matched


ROOT = Path(__file__).resolve().parents[1]


def prompt(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_rft_keeps_only_verified_answers_each_distinct_one_once():
    prompts, answers = [prompt("What is 3 + 4?"), prompt("What is 4 + 5?")], ["7", "9"]
    completions = [
        "3+4=7\n#### 7",
        "#### 7",
        "3+4=7\n#### 7 ",  # right, right (bare), a repeat of the first
        "#### 8",
        "4+5=9\n#### 9",
        "nine",
    ]
    rows, record = rft.verified_rows(prompts, answers, completions, samples=3)
    assert [(r["prompt"], r["completion"][0]["content"]) for r in rows] == [
        (prompts[0], "3+4=7\n#### 7"),
        (prompts[0], "#### 7"),
        (prompts[1], "4+5=9\n#### 9"),
    ]
    assert all(r["completion"][0]["role"] == "assistant" for r in rows)  # conversational: loss on the completion
    assert record == {
        "prompts": 2,
        "samples_per_prompt": 3,
        "sampled": 6,
        "verified": 4,
        "duplicates": 1,
        "over_cap": 0,
        "kept": 3,
        "prompts_kept": 2,
    }
    best_of_k, record = rft.verified_rows(prompts, answers, completions, samples=3, max_kept=1)
    assert [r["completion"][0]["content"] for r in best_of_k] == ["3+4=7\n#### 7", "4+5=9\n#### 9"]
    assert (record["over_cap"], record["duplicates"], record["kept"]) == (1, 1, 2)
    with pytest.raises(ValueError, match="5 completions for 2 prompts x 3 samples"):
        rft.verified_rows(prompts, answers, completions[:5], samples=3)


def test_sampled_tokens_are_counted_up_to_each_end_token():
    end, pad = 2, 0
    tokenizer = SimpleNamespace(convert_tokens_to_ids=lambda token: end)  # end of text and end of turn: id 2
    new = torch.tensor([[5, 6, end, pad, pad], [5, 5, 5, 5, 5], [end, pad, pad, pad, pad], [7, end, 7, end, pad]])
    assert generated_lengths(new, tokenizer) == 3 + 5 + 1 + 2


def write_stage(folder: Path, stage: str, compute: dict | None) -> str:
    folder.mkdir(parents=True)
    (folder / "run_info.json").write_text(json.dumps({"stage": stage, **({"compute": compute} if compute else {})}))
    return str(folder)


def test_the_compute_budget_sums_the_matched_chain_down_to_the_parent(tmp_path):
    pretrain = write_stage(tmp_path / "pretrain", "pretrain", {"steps": 10, "train_tokens": None, "parent": None})
    sft = write_stage(
        tmp_path / "sft", "sft", {"steps": 500, "train_tokens": 640_000, "sampling_tokens": 0, "parent": pretrain}
    )
    grpo = write_stage(
        tmp_path / "grpo", "grpo", {"steps": 50, "train_tokens": 160_000, "sampling_tokens": 160_000, "parent": sft}
    )
    chain = sft_matched.compute_chain(grpo, pretrain)
    assert [record["stage"] for record in chain] == ["grpo", "sft"]
    assert sft_matched.token_budget(chain) == 640_000 + 160_000 + 160_000
    # 960,000 tokens in batches of 32 examples of 40 tokens (1,280 a step): 750 steps; one token more, 751
    assert sft_matched.matched_steps(960_000, 40.0, 32) == 750 and sft_matched.matched_steps(960_001, 40.0, 32) == 751
    assert sft_matched.token_budget(sft_matched.compute_chain(grpo, sft)) == 320_000  # from sft: grpo alone
    with pytest.raises(ValueError, match="is this run's parent: there is no compute to match"):
        sft_matched.compute_chain(sft, sft)
    other = write_stage(tmp_path / "other", "pretrain", {"steps": 1, "train_tokens": 5, "parent": None})
    with pytest.raises(ValueError, match=r"chain of parents ends at .*pretrain without reaching this run's parent"):
        sft_matched.compute_chain(grpo, other)
    old = write_stage(tmp_path / "old", "grpo", None)
    with pytest.raises(ValueError, match=r"records no token count .*retrain that stage"):
        sft_matched.compute_chain(old, pretrain)


def correct(pattern: str) -> list[int]:
    return [int(c) for c in pattern]


def test_gains_against_the_baselines_are_paired_bootstraps_of_the_same_problems():
    results = {
        "pretrain": {"correct": correct("0000000000")},
        "sft": {"correct": correct("1100000000")},
        "grpo": {"correct": correct("1111110000")},
        "rft": {"correct": correct("1111000000")},
        "sft_matched": {"correct": correct("1111100000")},
    }
    baselines.add_baseline_gains(results)
    grpo = results["grpo"]["baseline_gains"]
    assert list(grpo) == ["rft", "sft_matched"]
    assert grpo["rft"] == paired_bootstrap(correct("1111110000"), correct("1111000000")).to_dict()
    assert grpo["rft"]["difference"] == pytest.approx(0.2) and grpo["sft_matched"]["difference"] == pytest.approx(0.1)
    # sft is rft's parent (not compared with it), not sft_matched's; pretrain is the ancestor of both; baselines: none
    assert list(results["sft"]["baseline_gains"]) == ["sft_matched"]
    assert all("baseline_gains" not in results[s] for s in ("pretrain", "rft", "sft_matched"))
    assert baselines.baseline_gains_text(results["grpo"]).startswith("vs rft +20.0 (")
    assert baselines.baseline_gains_text(results["rft"]) == "—"


def test_seed_table_reports_paired_t_tests_against_each_baseline(tmp_path):
    """Three runs: the gain of grpo over rft and over sft_matched, as a paired t-test over the runs (checked against
    scipy), and each run's paired bootstrap figures as the pipeline recorded them."""
    from scipy import stats as scipy_stats

    grpo, rft_scores, matched = [0.60, 0.70, 0.65], [0.55, 0.58, 0.61], [0.50, 0.66, 0.62]
    directories = []
    for index in range(3):
        run = {
            "pretrain": {"train_seconds": 5.0, "exact_match": 0.0, "gain": None},
            "sft": {"train_seconds": 5.0, "exact_match": 0.3, "gain": {"difference": 0.3, "p_value": 0.01}},
        }
        for stage, scores, parent in (("grpo", grpo, 0.3), ("rft", rft_scores, 0.3), ("sft_matched", matched, 0.0)):
            run[stage] = {
                "train_seconds": 5.0,
                "exact_match": scores[index],
                "gain": {"difference": scores[index] - parent, "p_value": 0.01},
            }
        run["grpo"]["baseline_gains"] = {
            "rft": {"difference": grpo[index] - rft_scores[index], "p_value": 0.01 * (index + 1)},
            "sft_matched": {"difference": grpo[index] - matched[index], "p_value": 0.5},
        }
        run["grpo"]["compute"] = {"steps": 50, "train_tokens": 160_000, "sampling_tokens": 160_000}
        folder = tmp_path / f"seed{index}"
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps(run))
        directories.append(str(folder))
    table = seeds.main(directories)
    row = next(line for line in table.splitlines() if line.startswith("| grpo |"))
    for baseline, scores in (("rft", rft_scores), ("sft_matched", matched)):
        differences = [a - b for a, b in zip(grpo, scores, strict=True)]
        mean = statistics.mean(differences)
        half = scipy_stats.t.ppf(0.975, 2) * statistics.stdev(differences) / math.sqrt(3)
        p = scipy_stats.ttest_rel(grpo, scores).pvalue
        interval = f"({(mean - half) * 100:+.1f}, {(mean + half) * 100:+.1f})"
        assert f"vs {baseline} {mean * 100:+.1f} {interval}, p {p:.2g}" in row
    assert "per run +5.0 (p 0.01), +12.0 (p 0.02), +4.0 (p 0.03)" in row
    assert row.endswith("| 5 |")  # the training time stays the last column
    assert "- grpo: compute 50 steps, 160,000 tokens trained + 160,000 sampled" in table
    assert baselines.COMPUTE_RULE in table


def test_the_pipeline_chains_the_baselines(tmp_path):
    configs = micro_stage_configs(tmp_path)
    args = PipelineArguments(output_dir=str(tmp_path / "out"), stage_configs=configs, matched_stage="rlhf")
    argv = stage_argv(args, "sft_matched")
    assert argv[argv.index("--model_name_or_path") + 1] == str(tmp_path / "out/pretrain")
    assert argv[argv.index("--match_compute_of") + 1] == str(tmp_path / "out/rlhf")
    argv = stage_argv(args, "rft")
    assert argv[argv.index("--model_name_or_path") + 1] == str(tmp_path / "out/sft")
    without = PipelineArguments(stages=["pretrain", "sft", "sft_matched"], stage_configs=configs)
    with pytest.raises(ValueError, match=r"reads the 'grpo' stage through --match_compute_of .*not in stages"):
        stage_argv(without, "sft_matched")
    with pytest.raises(ValueError, match="--matched_stage 'reward': choose one of grpo, rlhf, dpo, rft"):
        PipelineArguments(matched_stage="reward")
    assert [name for name in STAGES if STAGES[name].baseline] == ["rft", "sft_matched"]


def test_a_micro_pipeline_trains_the_baselines_and_compares_the_rl_stage_with_them(tmp_path, monkeypatch, capsys):
    """pretrain -> sft -> grpo, sft -> rft, pretrain -> sft_matched for two steps each (sft_matched: the steps its
    budget gives); rft's verifier is stubbed (the first sample of each prompt right), as a 2-step model answers none."""
    from plugformer.experiments.pipeline import main as pipeline_main

    first_of_two = lambda completions, answer, **kwargs: [float(i % 2 == 0) for i in range(len(completions))]  # noqa: E731
    monkeypatch.setattr(rft, "verified_rows", functools.partial(rft.verified_rows, verify=first_of_two))
    out = tmp_path / "out"
    results = pipeline_main(
        [
            "--config",
            str(ROOT / "configs/pipeline/tiny.yaml"),
            "--output_dir",
            str(out),
            "--stage_configs",
            micro_stage_configs(tmp_path),
            "--stages",
            "pretrain",
            "sft",
            "grpo",
            "rft",
            "sft_matched",
            "--test_examples",
            "6",
            "--max_new_tokens",
            "6",
            "--jobs",
            "1",
        ]
    )
    info = {stage: json.loads((out / stage / "run_info.json").read_text()) for stage in results}
    assert info["rft"]["sampling"]["sampled"] == 48 * 2 and info["rft"]["sampling"]["verified"] == 48
    assert info["rft"]["sampling"]["kept"] + info["rft"]["sampling"]["duplicates"] == 48
    assert info["rft"]["compute"]["sampling_tokens"] > 96 and info["rft"]["compute"]["steps"] == 2
    assert info["rft"]["compute"]["parent"] == str(out / "sft")  # the parent recorded with the compute
    assert info["grpo"]["compute"]["sampling_tokens"] == info["grpo"]["compute"]["train_tokens"] > 0
    matched = info["sft_matched"]["matched_compute"]
    budget = sum(info[s]["compute"]["train_tokens"] + info[s]["compute"]["sampling_tokens"] for s in ("sft", "grpo"))
    assert [r["stage"] for r in matched["stages"]] == ["grpo", "sft"] and matched["token_budget"] == budget
    steps = math.ceil(budget / (8 * matched["tokens_per_example"]))
    assert matched["steps"] == info["sft_matched"]["compute"]["steps"] == steps
    assert info["sft_matched"]["compute"]["parent"] == str(out / "pretrain")
    assert info["sft_matched"]["data"]["direct_answer_fraction"] == 0.0
    assert list(results["grpo"]["baseline_gains"]) == ["rft", "sft_matched"]
    table = (out / "results.md").read_text()
    assert "gain over baselines (95% CI), p" in table and baselines.COMPUTE_RULE in table
    assert f"pipeline('text-generation', model={str(out / 'grpo')!r})" in capsys.readouterr().out  # not a baseline


def test_the_same_difference_in_every_run_is_reported_as_such_not_as_a_tiny_p_value():
    """Three seeds each one problem of 300 apart: float subtraction left a spread near 1e-16 and the t-test printed
    `+0.3 (+0.3, +0.3), p 1.2e-28`; the rule for zero spread applies, and the table says there was none."""
    from plugformer.evaluation.stats import paired_t_test
    from plugformer.experiments.baselines import over_runs_text
    from plugformer.experiments.seeds import interval_text

    a, b = [292 / 300, 294 / 300, 293 / 300], [291 / 300, 293 / 300, 292 / 300]
    assert len({x - y for x, y in zip(a, b, strict=True)}) > 1  # the float differences are not all equal
    test = paired_t_test(a, b)
    assert test.no_spread and test.p_value == 0.0 and test.low == test.high == pytest.approx(1 / 300)
    assert over_runs_text(test) == "+0.3 in every run (no spread to test)"
    same = paired_t_test(a, a)
    assert same.no_spread and same.p_value == 1.0 and same.difference == 0.0
    spread = paired_t_test([0.5, 0.7, 0.6], [0.4, 0.5, 0.6])
    assert not spread.no_spread and over_runs_text(spread).endswith(f"p {spread.p_value:.2g}")
    # a rate's t interval is cut to [0, 100]: mean 0.93, s = sqrt(0.0086 / 2), t_{2, 0.975} = 4.3027: half-width
    # 0.1629, so (76.7, 109.3) uncut
    assert interval_text([0.86, 0.99, 0.94]) == "93.0 (76.7, 100.0)"


def test_the_shipped_compute_matched_baseline_trains_on_the_demonstrations_sft_had():
    """The baseline is SFT on the same data: the shipped configs give it sft's demonstrations (the problem stream's
    first `train_examples`, all worked; more of the same stream where it is given more), never other ones."""
    from plugformer.training import parse_stage_arguments
    from plugformer.training.data import stage_data

    def train_rows(stage: str):
        argv = ["--config", str(ROOT / f"configs/{stage}/tiny.yaml"), "--output_dir", "o"]
        script_args = parse_stage_arguments(stage, argv)[0]
        script_args.dev_examples = script_args.test_examples = 0
        return stage_data(STAGES[stage], script_args)["train"]

    sft_rows, matched_rows = train_rows("sft"), train_rows("sft_matched")
    assert len(matched_rows) >= len(sft_rows) == 3200
    head = matched_rows.select(range(len(sft_rows)))
    assert head["completion"] == sft_rows["completion"] and head["prompt"] == sft_rows["prompt"]
    assert all("####" in turns[0]["content"] and "=" in turns[0]["content"] for turns in matched_rows["completion"])
