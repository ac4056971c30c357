"""Statistics checked against scipy, and `plugformer compare`: end to end on a tiny grid, the options it refuses in
`--set` and `--grid` because it sets them per run, config fields routed into one `--config_overrides`, and score
caches keyed by the model's config and tokenizer too."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import refuse_training
from scipy import stats

from plugformer.evaluation.stats import mean_interval, paired_bootstrap, paired_t_test
from plugformer.experiments import compare as compare_module
from plugformer.experiments.compare import CompareArguments, run
from plugformer.experiments.grid import parse_grid, route, variants


SAMPLES = [[0.61, 0.55, 0.70], [1.0, 2.0, 3.0, 4.0, 10.0], [0.2, 0.2, 0.21, 0.19, 0.2, 0.25]]


@pytest.mark.parametrize("values", SAMPLES)
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_mean_interval_equals_scipy_t_interval(values, confidence):
    interval = mean_interval(values, confidence)
    low, high = stats.t.interval(confidence, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert (interval.low, interval.high) == pytest.approx((low, high), rel=1e-12)
    assert interval.mean == pytest.approx(np.mean(values))


def test_mean_interval_textbook_value_and_single_seed():
    # mean 2, s = 1, n = 3: 2 ± 4.302653 / sqrt(3) (t table: t_{2, 0.975} = 4.303)
    assert mean_interval([1.0, 2.0, 3.0]).half_width == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    single = mean_interval([0.5])
    assert single.mean == 0.5 and math.isnan(single.low) and math.isnan(single.high)
    with pytest.raises(ValueError, match="confidence"):
        mean_interval([1.0, 2.0], confidence=1.5)
    with pytest.raises(ValueError, match="nan or inf"):
        mean_interval([1.0, float("nan")])


@pytest.mark.parametrize("seed", range(4))
def test_paired_t_test_equals_scipy(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=5)
    b = a + rng.normal(0.2, 0.5, size=5)
    result = paired_t_test(a, b)
    reference = stats.ttest_rel(a, b)
    assert result.p_value == pytest.approx(reference.pvalue, rel=1e-10)
    assert result.difference == pytest.approx(np.mean(a - b))
    interval = reference.confidence_interval(0.95)
    assert (result.low, result.high) == pytest.approx((interval.low, interval.high), rel=1e-10)


def test_paired_t_test_degenerate_cases():
    assert paired_t_test([1.0, 2.0], [1.0, 2.0]).p_value == 1.0  # identical: no evidence
    assert paired_t_test([2.0, 3.0], [1.0, 2.0]).p_value == 0.0  # the same +1 on every seed
    with pytest.raises(ValueError, match="at least 2 pairs"):
        paired_t_test([1.0], [2.0])
    with pytest.raises(ValueError, match="same length"):
        paired_t_test([1.0, 2.0], [2.0])


def test_paired_bootstrap_interval_agrees_with_scipy():
    rng = np.random.default_rng(1)
    a = rng.normal(size=300)
    b = a + rng.normal(-0.3, 1.0, size=300)
    result = paired_bootstrap(a, b, samples=20_000)
    reference = stats.bootstrap(
        (a, b),
        lambda x, y, axis: x.mean(axis) - y.mean(axis),
        paired=True,
        method="percentile",
        n_resamples=20_000,
        random_state=0,
    ).confidence_interval
    assert result.difference == pytest.approx(np.mean(a - b))
    # two Monte Carlo estimates of the same percentiles (standard error ≈ 0.06 / sqrt(300) ≈ 0.0035 of the spread)
    assert result.low == pytest.approx(reference.low, abs=0.01)
    assert result.high == pytest.approx(reference.high, abs=0.01)


def test_paired_bootstrap_weighted_statistic_is_a_ratio_of_sums():
    # per-document summed losses and token counts: the statistic is the per-token loss
    losses_a, losses_b, tokens = [4.0, 9.0, 2.0], [5.0, 9.0, 4.0], [2, 3, 1]
    result = paired_bootstrap(losses_a, losses_b, weights=tokens, samples=1000)
    assert result.difference == pytest.approx((15 - 18) / 6)
    with pytest.raises(ValueError, match="positive weight"):
        paired_bootstrap([1.0], [1.0], weights=[0])


def test_planted_difference_is_significant_and_identical_systems_are_not():
    rng = np.random.default_rng(0)
    correct_a = (rng.random(400) < 0.75).astype(float)  # a clearly better system: 75% vs 60% exact match
    correct_b = correct_a * (rng.random(400) < 0.8)  # B gets a fifth of A's correct answers wrong
    planted = paired_bootstrap(correct_a, correct_b)
    assert planted.difference > 0.1 and planted.significant()
    assert planted.p_value == pytest.approx(1 / 10_001)  # never reported as exactly 0
    same = paired_bootstrap(correct_a, correct_a.copy())
    assert same.p_value == 1.0 and not same.significant()


def test_bootstrap_false_positive_rate_under_the_null():
    # two systems drawn from the same distribution: about 5% of comparisons may come out significant, not more
    rng = np.random.default_rng(3)
    rejections = sum(
        paired_bootstrap(rng.random(100) < 0.5, rng.random(100) < 0.5, samples=1000, seed=i).significant()
        for i in range(60)
    )
    assert rejections <= 8, rejections  # binomial(60, 0.05): P(X > 8) < 0.2%


def test_grid_parsing_and_routing():
    grid = parse_grid(["attention_score=dot,additive", "learning_rate=1e-3,3e-3"])
    assert variants(grid)[1] == {"attention_score": "dot", "learning_rate": "3e-3"}
    assert len(variants(grid)) == 4
    argv = route(
        {"attention_score": "dot", "learning_rate": "1e-3", "norm_type": "layernorm", "sft.max_steps": "5"},
        ["pretrain", "sft"],
    )
    assert argv["pretrain"] == [
        "--attention_score",
        "dot",
        "--learning_rate",
        "1e-3",
        "--config_overrides",
        "norm_type=layernorm",
    ]
    assert argv["sft"] == ["--learning_rate", "1e-3", "--max_steps", "5"]
    with pytest.raises(ValueError, match="no stage in"):
        route({"hiden_size": "4"}, ["pretrain"])
    with pytest.raises(ValueError, match="stage 'dpo'"):
        route({"dpo.beta": "0.1"}, ["pretrain", "sft"])
    for bad in (["attention_score"], ["attention_score="], ["a=1", "a=2"]):
        with pytest.raises(ValueError, match="grid entry"):
            parse_grid(bad)
    with pytest.raises(ValueError, match="metric"):
        CompareArguments(metric="bleu")
    with pytest.raises(ValueError, match="ttest"):
        CompareArguments(significance="ttest", seeds=[0])


CONFIGS = str(Path(__file__).parents[1] / "configs" / "{stage}" / "tiny.yaml")
TINY = ["max_steps=6", "train_examples=400", "dev_examples=40", "eval_strategy=no", "save_strategy=no",
        "report_to=none", "logging_steps=2", "hidden_size=32", "num_hidden_layers=1", "vocab_size=300"]  # fmt: skip


def tiny_compare(tmp_path, grid, **kwargs) -> CompareArguments:
    return CompareArguments(
        output_dir=str(tmp_path),
        grid=grid,
        seeds=[0, 1],
        set=TINY,
        dev_examples=30,
        test_examples=60,
        bootstrap_samples=2000,
        stage_configs=CONFIGS,
        **kwargs,
    )


def test_compare_end_to_end_reports_a_planted_difference_and_reuses_runs(tmp_path, monkeypatch):
    # learning rate 0 leaves the model at its initialisation: a planted, clearly worse variant
    args = tiny_compare(tmp_path, ["learning_rate=0.003,0.0"])
    summary = run(args)
    assert summary["best"] == "learning_rate=0.003"
    worse = summary["variants"]["learning_rate=0.0"]
    assert worse["versus_best"]["significant"] and worse["versus_best"]["difference"] < 0  # best has the lower loss
    assert worse["test"]["mean"] > summary["variants"]["learning_rate=0.003"]["test"]["mean"]
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["best"] == "learning_rate=0.003" and set(written["variants"]) == set(summary["variants"])
    assert "| **learning_rate=0.003** |" in (tmp_path / "results.md").read_text()
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "results.png").shape[:2] == (int((1.6 + 0.6 * 2) * 100), 900)

    # the same settings again: nothing is trained or scored, the report is identical
    def refuse(*_, **__):
        raise AssertionError("a finished run was retrained")

    monkeypatch.setattr("plugformer.training.run_stage", refuse)
    monkeypatch.setattr(compare_module, "_score", refuse)
    assert run(args)["variants"] == summary["variants"]
    # a changed setting is a different run: it trains
    with pytest.raises(AssertionError, match="retrained"):
        run(tiny_compare(tmp_path, ["learning_rate=0.003,0.001"]))


def test_compare_identical_variants_are_not_significant(tmp_path):
    # logging frequency does not change training: the two variants are the same models
    summary = run(tiny_compare(tmp_path, ["logging_steps=1,3"], significance="ttest"))
    other = next(row for name, row in summary["variants"].items() if name != summary["best"])
    assert other["versus_best"]["p_value"] == 1.0 and not other["versus_best"]["significant"]
    assert other["test"]["mean"] == summary["variants"][summary["best"]]["test"]["mean"]


def test_command_line_options_are_not_abbreviated():
    from plugformer.runtime.arguments import parse_arguments

    with pytest.raises(ValueError, match=r"unknown arguments \['--seed'"):  # not silently read as --seeds
        parse_arguments(CompareArguments, ["--seed", "3"], prog="plugformer compare")
    assert parse_arguments(CompareArguments, ["--seeds", "3"], prog="plugformer compare").seeds == [3]


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
    from plugformer.experiments import compare

    monkeypatch.setattr("plugformer.training.run_stage", refuse_training)
    kwargs = {"set": [entry]} if where == "set" else {"grid": [entry]}
    args = compare.CompareArguments(output_dir=str(tmp_path), seeds=[0, 1], stage_configs=CONFIGS, **kwargs)
    name = entry.partition("=")[0].rpartition(".")[2]
    with pytest.raises(ValueError, match=rf"--{where} {entry.split(',')[0]}.*compare sets {name!r} itself.*{allowed}"):
        compare.run(args)
    assert not (tmp_path / "runs").exists()


def test_compare_merges_config_overrides_with_config_fields_of_the_grid():
    from plugformer.experiments.grid import route

    argv = route({"config_overrides": "ffn_type=mlp", "norm_type": "layernorm"}, ["pretrain"])
    assert argv["pretrain"] == ["--config_overrides", "ffn_type=mlp,norm_type=layernorm"]  # one flag, both fields
    with pytest.raises(ValueError, match=r"\['norm_type'\] set more than once"):
        route({"config_overrides": "norm_type=rmsnorm", "norm_type": "layernorm"}, ["pretrain"])


def test_the_score_caches_are_keyed_by_the_models_config_and_tokenizer_too(tmp_path):
    from plugformer.experiments.compare import CompareArguments, score_key
    from plugformer.experiments.extrapolation import ExtrapolationArguments, evaluation_key

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text('{"position_scheme": "rope"}')
    (tmp_path / "tokenizer.json").write_text('{"vocab": 1}')
    keys = lambda: (score_key(CompareArguments(), tmp_path, "test"), evaluation_key(ExtrapolationArguments(), tmp_path))  # noqa: E731
    first = keys()
    assert keys() == first
    (tmp_path / "run_info.json").write_text("{}")  # a record beside the model changes no score
    assert keys() == first
    (tmp_path / "config.json").write_text('{"position_scheme": "nope"}')  # same weights, another model
    second = keys()
    assert second[0] != first[0] and second[1] != first[1]
    (tmp_path / "tokenizer.json").write_text('{"vocab": 2}')
    third = keys()
    assert third[0] != second[0] and third[1] != second[1]
