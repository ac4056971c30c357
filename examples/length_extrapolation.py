"""Does a position scheme let a model read longer texts than it was trained on? Trains one small causal LM per
scheme at 64 tokens on the same data and reports test perplexity at 32..512 tokens (the ALiBi paper's Figure 1
setup, `plugformer extrapolate`). Learned absolute positions end at their table: reported, not crashed.

    python examples/length_extrapolation.py            # seven schemes, about 10 minutes on 2 CPU cores
    python examples/length_extrapolation.py --quick    # a 30-second smoke version

Writes `<output_dir>/results.md`, `results.json` and `results.png` (perplexity vs length, log-log).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plugformer import POSITION_SCHEMES
from plugformer.experiments.extrapolation import ExtrapolationArguments, run


CONFIGS = str(Path(__file__).resolve().parents[1] / "configs" / "{stage}" / "tiny.yaml")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="outputs/examples/extrapolation")
    parser.add_argument("--schemes", nargs="+", default=POSITION_SCHEMES.names())
    parser.add_argument("--train_length", type=int, default=64)
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="a few steps of a smaller model")
    args = parser.parse_args(argv)
    budget = [f"max_steps={args.max_steps}", "eval_strategy=no", "save_strategy=no"]
    if args.quick:
        budget = [
            "max_steps=6",
            "train_examples=400",
            "eval_strategy=no",
            "save_strategy=no",
            "report_to=none",
            "hidden_size=32",
            "num_hidden_layers=1",
            "vocab_size=300",
        ]
    return run(
        ExtrapolationArguments(
            output_dir=args.output_dir,
            position_schemes=args.schemes,
            train_length=16 if args.quick else args.train_length,
            stage_configs=CONFIGS,
            set=budget,
            eval_windows=2 if args.quick else 8,
            test_examples=300 if args.quick else 2000,
        )
    )


if __name__ == "__main__":
    main()
