"""Several pipeline runs (one per seed) in one table: `plugformer seeds DIR [DIR ...]`.

Each stage's held-out exact match is shown as its mean with a 95% t interval over the runs, and its gain over its
parent two ways: per run (the pipeline's paired bootstrap over the same test problems, its p-value) and over runs
(a paired t-test of the per-run gains, which also counts how much a seed moves the result); its gain over the
baseline stages (rft, sft_matched) the same two ways (`experiments/baselines.py`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..evaluation.stats import mean_interval, paired_t_test
from ..runtime.files import write_text_atomic
from ..training import STAGES
from .baselines import COMPUTE_RULE, compute_text, over_runs_text, seed_baseline_text
from .pipeline import RUN_RECORD


def load_runs(directories: list[str]) -> list[dict]:
    """The `results.json` of each pipeline output directory, in order. Refused, before any number is printed: a
    directory without one, fewer than two distinct runs, one run given twice (`same_run`), runs scored on different
    test sets (`check_test_sets`)."""
    if not directories:
        raise ValueError("give at least two pipeline output directories (each holding results.json)")
    runs = []
    for directory in directories:
        path = Path(directory, "results.json")
        if not path.is_file():
            raise ValueError(f"{directory}: no results.json (a finished `plugformer pipeline --output_dir` folder)")
        runs.append(json.loads(path.read_text()))
    for later in range(len(directories)):
        for earlier in range(later):
            why = same_run(directories[earlier], directories[later])
            if why is not None:
                raise ValueError(
                    f"plugformer seeds: {directories[earlier]} and {directories[later]} are the same run "
                    f"({why}): give each run once; intervals and tests over seeds count distinct runs"
                )
    if len(runs) < 2:
        raise ValueError(
            f"plugformer seeds: {len(runs)} run given ({', '.join(directories)}); intervals and paired "
            "tests over seeds need at least two distinct runs (pipeline runs with different --seed)"
        )
    check_test_sets(runs, directories)
    return runs


def run_identity(directory: str) -> dict:
    """What identifies a pipeline run by content: its folder's absolute path, the sha256 of its results.json, the
    parameter digests each stage recorded in its run_info.json (the trained weights) and the seed it ran with."""
    folder = Path(directory).resolve()
    digests = {}
    for stage in STAGES:
        info = folder / stage / "run_info.json"
        if info.is_file():
            digests[stage] = json.loads(info.read_text()).get("parameter_digests")
    record = folder / RUN_RECORD
    return {
        "path": str(folder),
        "results_sha256": hashlib.sha256((folder / "results.json").read_bytes()).hexdigest(),
        "weights": digests if any(digests.values()) else None,
        "seed": json.loads(record.read_text()).get("seed") if record.is_file() else None,
    }


def same_run(first: str, second: str) -> str | None:
    """Why two directories hold the same run (one folder, a copy, the same weights, the same seed), or None."""
    a, b = run_identity(first), run_identity(second)
    if a["path"] == b["path"]:
        return f"both are {a['path']}"
    if a["results_sha256"] == b["results_sha256"]:
        return f"identical results.json, sha256 {a['results_sha256'][:12]}"
    if a["weights"] is not None and a["weights"] == b["weights"]:
        return "every stage's weights have the same parameter digests"
    if a["seed"] is not None and a["seed"] == b["seed"]:
        return f"both ran with --seed {a['seed']} ({RUN_RECORD})"
    return None


def test_set(result: dict) -> tuple[int | None, str | None]:
    """(problems or pairs scored, sha256 of their content) of one stage's held-out scores, None where unrecorded."""
    examples = result.get("examples", len(result["correct"]) if "correct" in result else None)
    return examples, result.get("data_sha256")


def check_test_sets(runs: list[dict], directories: list[str]) -> None:
    """Raises `ValueError` naming both runs when a stage was scored on test sets of different sizes or content."""
    for stage in STAGES:
        present = [(run[stage], directory) for run, directory in zip(runs, directories, strict=True) if stage in run]
        for result, directory in present[1:]:
            (size, digest), (first_size, first_digest) = test_set(result), test_set(present[0][0])
            if (size != first_size and None not in (size, first_size)) or (
                digest != first_digest and None not in (digest, first_digest)
            ):
                raise ValueError(
                    f"plugformer seeds: stage {stage!r} was scored on different test sets: "
                    f"{present[0][1]} {_test_set_text(first_size, first_digest)}, {directory} "
                    f"{_test_set_text(size, digest)}; score every run with the same --test_examples "
                    "and --dataset_seed"
                )


def _test_set_text(size: int | None, digest: str | None) -> str:
    return f"{size} examples" + (f" (sha256 {digest[:12]})" if digest else "")


def percent(value: float) -> str:
    return f"{value * 100:.1f}"


def interval_text(values: list[float]) -> str:
    """`mean (low, high)` in percent, the t interval cut to [0, 100]; the single value for one run."""
    interval = mean_interval(values)
    if interval.n < 2:  # not from `seed_table`, which refuses fewer than two runs
        return percent(interval.mean)
    # rates: a t interval over three runs can pass 100% (92.9 (80.3, 105.4)); what lies outside [0, 1] is no rate
    return f"{percent(interval.mean)} ({percent(max(interval.low, 0.0))}, {percent(min(interval.high, 1.0))})"


def stage_row(stage: str, runs: list[dict]) -> str:
    """One table row: test exact match over runs, the gain over the parent over runs and per run, times."""
    results = [run[stage] for run in runs]
    seconds = sum(r["train_seconds"] for r in results) / len(results)
    if "exact_match" not in results[0]:  # the reward model: pairwise accuracy
        accuracy = [r["pairwise_accuracy"] for r in results] if "pairwise_accuracy" in results[0] else None
        score = f"pairwise accuracy {interval_text(accuracy)}" if accuracy else "—"
        return f"| {stage} | {score} | — | — | — | {seconds:.0f} |"
    matches = [r["exact_match"] for r in results]
    score = interval_text(matches)
    asked = [r.get("pretraining_format") for r in results]  # a pretrained model, also asked as its corpus asks
    if all(value is not None for value in asked):
        score += f"; asked as in pretraining {interval_text([value['exact_match'] for value in asked])}"
    implicit = [r.get("implicit_reward_pairwise_accuracy") for r in results]  # a DPO policy as a reward model too
    if all(value is not None for value in implicit):
        score += f"; implicit reward pairwise accuracy {interval_text(implicit)}"
    elif any("implicit_reward_pairwise_accuracy" in r for r in results):  # some policy is its reference
        score += f"; implicit reward 0 for every answer in {sum(v is None for v in implicit)} of {len(results)} runs"
    parent = STAGES[stage].parent
    gains = [r.get("gain") for r in results]
    baselines = seed_baseline_text(stage, runs)
    if parent is None or any(g is None for g in gains):
        return f"| {stage} | {score} | — | — | {baselines} | {seconds:.0f} |"
    per_run = ", ".join(f"{g['difference'] * 100:+.1f} (p {g['p_value']:.2g})" for g in gains)
    if len(runs) > 1:
        test = paired_t_test(matches, [run[parent]["exact_match"] for run in runs])
        over = over_runs_text(test)
    else:
        over = "—"
    return f"| {stage} | {score} | {over} | {per_run} | {baselines} | {seconds:.0f} |"


def seed_table(runs: list[dict], names: list[str] | None = None) -> str:
    """The markdown table over `runs` (each a pipeline's results.json), stages in pipeline order."""
    stages = [stage for stage in STAGES if all(stage in run for run in runs)]
    lines = [
        f"{len(runs)} runs" + (f" ({', '.join(names)})" if names else "") + "; held-out test exact match in %, "
        "mean (95% t interval over runs)",
        "",
        "| stage | test exact match | gain over parent over runs (95% CI), paired t p | gain per run (paired "
        "bootstrap p) | gain over baselines over runs (95% CI), paired t p; per run (paired bootstrap p) | "
        "training time (s, mean) |",
        "|---|---|---|---|---|---|",
    ]
    rows = [stage_row(stage, runs) for stage in stages]
    notes = [compute_line(stage, runs) for stage in stages]
    notes = [note for note in notes if note]
    return "\n".join(lines + rows + (["", COMPUTE_RULE, *notes] if notes else []))


def compute_line(stage: str, runs: list[dict]) -> str | None:
    """`- grpo: compute ...` from the first run's results."""
    text = compute_text(runs[0][stage])
    return f"- {stage}: {text} (first run; token counts vary a little with the seed)" if text else None


def wall_times(directories: list[str]) -> str | None:
    """One line: each run's wall time with the machine's `torch.mm` rate it ran at (`pipeline_run.json`), or None
    when no run recorded them (runs before that record existed)."""
    parts = []
    for directory in directories:
        path = Path(directory, RUN_RECORD)
        if path.is_file():
            record = json.loads(path.read_text())
            parts.append(
                f"{Path(directory).name} {record['wall_seconds']:.0f} s "
                f"({record['machine']['matmul_gflops']:.0f} GFLOP/s)"
            )
    return "wall time per run (torch.mm rate of the machine): " + ", ".join(parts) if parts else None


def machines(directories: list[str]) -> str | None:
    """One line: what the runs ran on (`pipeline_run.json`'s `environment`: CPU, instruction set, torch, threads),
    saying so when they differ (another instruction set rounds otherwise, so the spread is then not the seeds'
    alone); None when no run recorded it."""
    from ..runtime.environment import environment_text

    texts = {}
    for directory in directories:
        path = Path(directory, RUN_RECORD)
        record = json.loads(path.read_text()) if path.is_file() else {}
        if record.get("environment"):
            texts[Path(directory).name] = environment_text(record["environment"])
    if not texts:
        return None
    if len(set(texts.values())) == 1 and len(texts) == len(directories):
        return f"every run on {next(iter(texts.values()))}"
    return (
        "runs on different or unrecorded machines (the spread mixes seeds and machines' floating-point "
        "rounding): " + "; ".join(f"{name} {text}" for name, text in texts.items())
    )


def main(argv: list[str]) -> str:
    """`plugformer seeds DIR [DIR ...] [--output FILE]`: prints (and writes) the table."""
    import argparse

    from ..runtime.arguments import REPEATED_FLAGS_RULE, merge_repeated_flags

    parser = argparse.ArgumentParser(
        prog="plugformer seeds", description=__doc__.split("\n")[0], allow_abbrev=False, epilog=REPEATED_FLAGS_RULE
    )
    parser.add_argument("directories", nargs="+", help="pipeline output directories, each holding results.json")
    parser.add_argument("--output", default=None, help="also write the table to this markdown file")
    args = parser.parse_args(merge_repeated_flags(parser, list(argv), parser.prog, extra=()))
    table = seed_table(load_runs(args.directories), names=[Path(d).name for d in args.directories])
    notes = [note for note in (wall_times(args.directories), machines(args.directories)) if note]
    table += "".join(f"\n\n{note}" for note in notes)
    print(table)
    if args.output:
        if Path(args.output).is_dir():
            raise ValueError(f"--output {args.output} is a folder; give the markdown file to write")
        write_text_atomic(Path(args.output), table + "\n")
    return table
