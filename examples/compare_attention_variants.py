"""Compare attention score functions honestly: each variant trained with the same data and budget over several
seeds, the best selected on dev, every variant reported on test with a 95% confidence interval and a paired
significance test against the best (`plugformer compare`).

    python examples/compare_attention_variants.py                 # 4 score functions x 3 seeds, about 15 minutes
    python examples/compare_attention_variants.py --quick         # a 1-minute smoke version of the same study

Writes `<output_dir>/results.md`, `results.json` and `results.png`; re-running reuses the finished runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plugformer.experiments.compare import CompareArguments, run


CONFIGS = str(Path(__file__).resolve().parents[1] / "configs" / "{stage}" / "tiny.yaml")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="outputs/examples/compare_attention")
    parser.add_argument("--scores", nargs="+", default=["dot", "scaled_dot", "multiplicative", "additive"])
    parser.add_argument("--position_scheme", default="rope")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--max_steps", type=int, default=150)
    parser.add_argument("--quick", action="store_true", help="a few steps of a smaller model on less data")
    args = parser.parse_args(argv)
    budget = [f"max_steps={args.max_steps}", "eval_strategy=no", "save_strategy=no"]
    if args.quick:
        budget = [
            "max_steps=8",
            "train_examples=400",
            "dev_examples=40",
            "eval_strategy=no",
            "save_strategy=no",
            "report_to=none",
            "hidden_size=32",
            "num_hidden_layers=1",
            "vocab_size=300",
        ]
    return run(
        CompareArguments(
            output_dir=args.output_dir,
            grid=[f"attention_score={','.join(args.scores)}", f"position_scheme={args.position_scheme}"],
            seeds=args.seeds,
            stage_configs=CONFIGS,
            set=budget,
            dev_examples=60 if args.quick else 300,
            test_examples=100 if args.quick else 500,
            bootstrap_samples=2000 if args.quick else 10_000,
        )
    )


if __name__ == "__main__":
    main()
