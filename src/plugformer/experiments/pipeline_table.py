"""The cells of `plugformer pipeline`'s results table: a stage's gain over its parent and its other scores."""

from __future__ import annotations

from ..training import STAGES
from .baselines import compute_text


def gain_over_parent(results: dict, stage: str) -> dict | None:
    """Test exact match of `stage` minus its parent's, paired over the same problems (the project's paired
    bootstrap: interval and two-sided p), or None where either has no per-problem scores or they scored other
    examples (`data_sha256`: classify's sentences against pretraining's problems)."""
    from ..evaluation.stats import paired_bootstrap

    parent = STAGES[stage].parent
    if parent not in results or "correct" not in results[stage] or "correct" not in results[parent]:
        return None
    if results[stage].get("data_sha256") != results[parent].get("data_sha256"):
        return None
    return paired_bootstrap(results[stage]["correct"], results[parent]["correct"]).to_dict()


def gain_text(gain: dict | None) -> str:
    if gain is None:
        return "—"
    return (
        f"{gain['difference'] * 100:+.1f} ({gain['low'] * 100:+.1f}, {gain['high'] * 100:+.1f}), "
        f"p {gain['p_value']:.3g}"
    )


def other_text(result: dict) -> str:
    parts = []
    if "macro_f1" in result:  # a classifier's (classify), on its own held-out rows
        parts.append(
            f"accuracy {result['accuracy']:.1%}, macro F1 {result['macro_f1']:.3f} ({result['examples']} held-out rows)"
        )
    if "chrf" in result:  # an encoder-decoder's (seq2seq), on its own held-out pairs
        parts.append(
            f"chrF {result['chrf']:.1f}, target perplexity {result['perplexity']:.3f} ({result['examples']} "
            "held-out pairs)"
        )
    if "pairwise_accuracy" in result:
        parts.append(f"pairwise accuracy {result['pairwise_accuracy']:.1%}")
    if result.get("implicit_reward_pairwise_accuracy") is not None:
        parts.append(f"implicit reward pairwise accuracy {result['implicit_reward_pairwise_accuracy']:.1%}")
    elif "implicit_reward_pairwise_accuracy" in result:  # the policy is its reference: every pair ties
        parts.append("implicit reward 0 for every answer (the policy is its reference)")
    if compute_text(result):
        parts.append(compute_text(result))
    if result.get("eval_perplexity"):
        parts.append(f"dev perplexity {result['eval_perplexity']:.2f}")
    if result.get("dev_pass_at_k"):
        parts.append(", ".join(f"dev {k} {v:.1%}" for k, v in result["dev_pass_at_k"].items() if k.startswith("pass@")))
    if result.get("processes"):
        parts.append(f"trained on {result['processes']} processes (data parallel, same effective batch)")
    if result.get("selection"):
        selection = result["selection"]
        chosen, last, signal = selection["selected"], selection["last"], selection["signal"]
        value = "{:.1%}" if signal.endswith(("exact_match", "accuracy")) else "{:.3f}"
        parts.append(
            f"dev ({signal}): step {chosen['step']} selected ({value.format(chosen[signal])}), "
            f"last step {last['step']} {value.format(last[signal])}"
        )
    return "; ".join(parts)
