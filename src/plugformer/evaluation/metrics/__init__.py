"""Metrics as local 🤗 evaluate modules: `evaluate.load` on a Hub name needs the network, these load offline.

`load_metric("numeric_exact_match")` is `evaluate.load(<this folder>/numeric_exact_match.py)`.
"""

from __future__ import annotations

from pathlib import Path


METRICS = tuple(sorted(path.stem for path in Path(__file__).parent.glob("*.py") if path.stem != "__init__"))


def load_metric(name: str):
    """An `evaluate.EvaluationModule` shipped with plugformer, loaded without network access."""
    import evaluate

    if name not in METRICS:
        raise ValueError(f"metric {name!r} is not one of plugformer's offline metrics {METRICS}")
    return evaluate.load(str(Path(__file__).parent / f"{name}.py"))
