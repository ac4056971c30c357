"""The baselines in the results tables: each stage's gain against the baseline stages (rft, sft_matched: records
with `baseline=True`) of the same run, and the compute each stage used.

A baseline is compared with every other stage of the run that is not a baseline and not one of its ancestors (rft
starts from sft: sft is not compared with it); per run by the paired bootstrap over the same test problems (as the
gain over the parent), over runs by `plugformer seeds`' paired t-test of the per-run scores.
"""

from __future__ import annotations

from ..evaluation.stats import paired_bootstrap, paired_t_test
from ..training import STAGES


def over_runs_text(test) -> str:
    """A paired t-test over runs in points: `+d (low, high), p`, or `+d in every run (no spread to test)`."""
    if test.no_spread:
        return f"{test.difference * 100:+.1f} in every run (no spread to test)"
    return f"{test.difference * 100:+.1f} ({test.low * 100:+.1f}, {test.high * 100:+.1f}), p {test.p_value:.2g}"


COMPUTE_RULE = (
    "compute: optimizer steps and tokens processed = tokens trained on + tokens sampled (TRL's counts: "
    "prompt and completion tokens, padding excluded); a compute-matched baseline trains on as many tokens "
    "as its matched stage and that stage's ancestors down to the baseline's parent processed, a sampled "
    "token counted as a trained one"
)


def ancestors(stage: str) -> set[str]:
    """The stages `stage` descends from through its parents."""
    found, parent = set(), STAGES[stage].parent
    while parent is not None and parent not in found:
        found.add(parent)
        parent = STAGES[parent].parent
    return found


def compared_baselines(stage: str, stages: list[str]) -> list[str]:
    """The baseline stages of `stages` that `stage`'s gain is reported against (none for a baseline itself)."""
    if STAGES[stage].baseline:
        return []
    return [b for b in stages if STAGES[b].baseline and stage not in ancestors(b)]


def add_baseline_gains(results: dict) -> None:
    """Adds `baseline_gains` ({baseline: paired bootstrap of the test exact match, stage minus baseline}) to each
    row of `results` (one pipeline run's, stage by stage) that has baselines to compare with and per-problem scores."""
    stages = list(results)
    for stage in stages:
        gains = {
            baseline: paired_bootstrap(results[stage]["correct"], results[baseline]["correct"]).to_dict()
            for baseline in compared_baselines(stage, stages)
            if "correct" in results[stage] and "correct" in results[baseline]
        }
        if gains:
            results[stage]["baseline_gains"] = gains


def baseline_gains_text(result: dict) -> str:
    """`vs rft +3.0 (+1.0, +5.0), p 0.01; vs sft_matched ...` for a pipeline table row, `—` without baselines."""
    gains = result.get("baseline_gains") or {}
    if not gains:
        return "—"
    return "; ".join(
        f"vs {baseline} {g['difference'] * 100:+.1f} ({g['low'] * 100:+.1f}, {g['high'] * 100:+.1f}), "
        f"p {g['p_value']:.3g}"
        for baseline, g in gains.items()
    )


def compute_text(result: dict) -> str | None:
    """`500 steps, 1.2M tokens trained + 0.3M sampled` (and what a matched baseline matched), or None."""
    compute = result.get("compute")
    if not compute or compute.get("train_tokens") is None:
        return None
    text = f"compute {compute['steps']} steps, {tokens_text(compute['train_tokens'])} tokens trained"
    if compute.get("sampling_tokens"):
        text += f" + {tokens_text(compute['sampling_tokens'])} sampled"
    sampled = result.get("sampling")
    if sampled:
        text += (
            f" (kept {sampled['kept']} distinct verified of {sampled['sampled']} samples, sampled in "
            f"{sampled.get('sampling_seconds', 0):.0f} s)"
        )
    matched = result.get("matched_compute")
    if matched:
        chain = " + ".join(record["stage"] for record in reversed(matched["stages"]))
        text += f" (matched to {chain}: {tokens_text(matched['token_budget'])} tokens)"
    return text


def tokens_text(count: int) -> str:
    """`1.23M` from a million tokens on, else the count with thousands separators.

    >>> tokens_text(1_234_567), tokens_text(98_765)
    ('1.23M', '98,765')
    """
    return f"{count / 1e6:.2f}M" if count >= 1_000_000 else f"{count:,}"


def seed_baseline_text(stage: str, runs: list[dict]) -> str:
    """`plugformer seeds`' baseline column of `stage`: per baseline, the paired t-test of its exact match against the
    baseline's over runs (95% interval, p), then each run's paired bootstrap difference and p."""
    gains = [run[stage].get("baseline_gains") or {} for run in runs]
    parts = []
    for baseline in gains[0]:
        if not all(baseline in g for g in gains) or len(runs) < 2:
            continue
        scores = [run[stage]["exact_match"] for run in runs]
        test = paired_t_test(scores, [run[baseline]["exact_match"] for run in runs])
        per_run = ", ".join(f"{g[baseline]['difference'] * 100:+.1f} (p {g[baseline]['p_value']:.2g})" for g in gains)
        parts.append(f"vs {baseline} {over_runs_text(test)}; per run {per_run}")
    return "; ".join(parts) or "—"
