"""matplotlib for the evaluation and training code: figures written to files, nothing displayed.

The lowest module of `evaluation`: the plots, attention maps, comparison and extrapolation figures (and the dev-set
selection plot of `training.selection`) all draw through it, and it imports none of them.
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend: files only, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
