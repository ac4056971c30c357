"""Several pipeline runs (one per seed) in one table: `plugformer seeds DIR [DIR ...]`.

Each stage's held-out exact match is shown as its mean with a 95% t interval over the runs, and its gain over its
parent two ways: per run (the pipeline's paired bootstrap over the same test problems, its p-value) and over runs
(a paired t-test of the per-run gains, which also counts how much a seed moves the result).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..evaluation.stats import mean_interval, paired_t_test
from ..runtime.files import write_text_atomic
from ..training import STAGES
from .pipeline import RUN_RECORD


def load_runs(directories: list[str]) -> list[dict]:
    """The `results.json` of each pipeline output directory, in order; a directory without one is refused."""
    if not directories:
        raise ValueError("give at least one pipeline output directory (each holding results.json)")
    runs = []
    for directory in directories:
        path = Path(directory, "results.json")
        if not path.is_file():
            raise ValueError(f"{directory}: no results.json (a finished `plugformer pipeline --output_dir` folder)")
        runs.append(json.loads(path.read_text()))
    return runs


def percent(value: float) -> str:
    return f"{value * 100:.1f}"


def interval_text(values: list[float]) -> str:
    """`mean (low, high)` in percent, or the single value for one run."""
    interval = mean_interval(values)
    if interval.n < 2:
        return percent(interval.mean)
    return f"{percent(interval.mean)} ({percent(interval.low)}, {percent(interval.high)})"


def stage_row(stage: str, runs: list[dict]) -> str:
    """One table row: test exact match over runs, the gain over the parent over runs and per run, times."""
    results = [run[stage] for run in runs]
    seconds = sum(r["train_seconds"] for r in results) / len(results)
    if "exact_match" not in results[0]:  # the reward model: pairwise accuracy
        accuracy = [r["pairwise_accuracy"] for r in results] if "pairwise_accuracy" in results[0] else None
        score = f"pairwise accuracy {interval_text(accuracy)}" if accuracy else "—"
        return f"| {stage} | {score} | — | — | {seconds:.0f} |"
    matches = [r["exact_match"] for r in results]
    score = interval_text(matches)
    if all("implicit_reward_pairwise_accuracy" in r for r in results):  # a DPO policy scored as a reward model too
        implicit = interval_text([r["implicit_reward_pairwise_accuracy"] for r in results])
        score += f"; implicit reward pairwise accuracy {implicit}"
    parent = STAGES[stage].parent
    gains = [r.get("gain") for r in results]
    if parent is None or any(g is None for g in gains):
        return f"| {stage} | {score} | — | — | {seconds:.0f} |"
    per_run = ", ".join(f"{g['difference'] * 100:+.1f} (p {g['p_value']:.2g})" for g in gains)
    if len(runs) > 1:
        test = paired_t_test(matches, [run[parent]["exact_match"] for run in runs])
        over = f"{test.difference * 100:+.1f} ({test.low * 100:+.1f}, {test.high * 100:+.1f}), p {test.p_value:.2g}"
    else:
        over = "—"
    return f"| {stage} | {score} | {over} | {per_run} | {seconds:.0f} |"


def seed_table(runs: list[dict], names: list[str] | None = None) -> str:
    """The markdown table over `runs` (each a pipeline's results.json), stages in pipeline order."""
    stages = [stage for stage in STAGES if all(stage in run for run in runs)]
    lines = [
        f"{len(runs)} runs" + (f" ({', '.join(names)})" if names else "") + "; held-out test exact match in %, "
        "mean (95% t interval over runs)",
        "",
        "| stage | test exact match | gain over parent over runs (95% CI), paired t p | gain per run (paired "
        "bootstrap p) | training time (s, mean) |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(lines + [stage_row(stage, runs) for stage in stages])


def wall_times(directories: list[str]) -> str | None:
    """One line: each run's wall time with the machine's `torch.mm` rate it ran at (`pipeline_run.json`), or None
    when no run recorded them (runs before that record existed)."""
    parts = []
    for directory in directories:
        path = Path(directory, RUN_RECORD)
        if path.is_file():
            record = json.loads(path.read_text())
            parts.append(f"{Path(directory).name} {record['wall_seconds']:.0f} s "
                         f"({record['machine']['matmul_gflops']:.0f} GFLOP/s)")  # fmt: skip
    return "wall time per run (torch.mm rate of the machine): " + ", ".join(parts) if parts else None


def main(argv: list[str]) -> str:
    """`plugformer seeds DIR [DIR ...] [--output FILE]`: prints (and writes) the table."""
    import argparse

    parser = argparse.ArgumentParser(prog="plugformer seeds", description=__doc__.split("\n")[0])
    parser.add_argument("directories", nargs="+", help="pipeline output directories, each holding results.json")
    parser.add_argument("--output", default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    table = seed_table(load_runs(args.directories), names=[Path(d).name for d in args.directories])
    times = wall_times(args.directories)
    table += f"\n\n{times}" if times else ""
    print(table)
    if args.output:
        if Path(args.output).is_dir():
            raise ValueError(f"--output {args.output} is a folder; give the markdown file to write")
        write_text_atomic(Path(args.output), table + "\n")
    return table
