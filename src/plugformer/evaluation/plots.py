"""`plugformer plot`: position schemes and training runs as PNG files.

- `sinusoidal`: the fixed sinusoidal encoding (Vaswani et al. 2017, §3.5) as a position × dimension heatmap;
- `positions`: the score bias a model's alibi / t5_bias / clamped_bias scheme adds, per head, against the signed
  distance key − query, computed by the scheme's own `bias()`;
- `curves`: loss (and eval loss, dashed) against the step, one colour per run directory, read from the Trainer's
  `trainer_state.json`, the tensorboard events under `runs/`, or the latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..positions import POSITION_SCHEMES, PositionScheme, sinusoidal_table
from .attention_maps import load_model
from .figures import pyplot, save_figure


# --- sinusoidal encoding ---------------------------------------------------------------------------------------


MAX_CELLS = 2**24  # values of the sinusoidal heatmap: 16M, far more than its pixels


def sinusoidal_matrix(positions: int, dim: int) -> torch.Tensor:
    """plugformer's sinusoidal table for positions `0..positions-1`, shape `(positions, dim)`.

    >>> [round(v, 3) for v in sinusoidal_matrix(2, 4)[1].tolist()]  # sin 1, cos 1, sin 0.01, cos 0.01
    [0.841, 0.54, 0.01, 1.0]
    """
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"positions={positions!r} must be an int >= 1")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"dim={dim!r} must be an even int >= 2 (sine and cosine pairs)")
    if positions * dim > MAX_CELLS:  # 2**63 positions overflowed torch's allocation with a RuntimeError traceback
        raise ValueError(
            f"positions={positions} x dim={dim}: {positions * dim} values, more than a heatmap shows "
            f"(at most {MAX_CELLS}); choose fewer positions or a smaller dim"
        )
    return sinusoidal_table(torch.arange(positions)[None], dim)[0]  # (1, P, d) -> (P, d)


def plot_sinusoidal(
    positions: int, dim: int, path: str | Path, *, dpi: int = 100, figsize: tuple[float, float] = (8, 5)
) -> np.ndarray:
    """Heatmap of [`sinusoidal_matrix`]: position on y, dimension on x (even columns sine, odd cosine).

    Returns:
        `np.ndarray` of shape `(positions, dim)`: the array drawn.
    """
    plt = pyplot()
    table = sinusoidal_matrix(positions, dim)
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    image = ax.imshow(table.numpy(), cmap="RdBu_r", vmin=-1.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set(
        xlabel="dimension i (even: sin, odd: cos)",
        ylabel="position",
        title=f"sinusoidal position encoding, d = {dim} (Vaswani et al. 2017)",
    )
    fig.colorbar(image, ax=ax)
    drawn = np.asarray(image.get_array())
    save_figure(fig, path, dpi)
    return drawn


# --- position bias against distance ----------------------------------------------------------------------------


def bias_schemes() -> list[str]:
    """The registered position schemes that add a bias to the attention scores."""
    return [name for name in POSITION_SCHEMES if POSITION_SCHEMES.get(name).has_bias]


def position_scheme_of(source, stack: str | None = None) -> PositionScheme:
    """The position scheme of a model, a config or a scheme.

    Args:
        source: a [`PositionScheme`], a [`PlugformerConfig`] (a freshly initialised scheme: learned tables are
            random) or a plugformer model (its trained scheme).
        stack (`str`, *optional*): `encoder` or `decoder` for a seq2seq model or config; defaults to the encoder.
    """
    if stack not in (None, "encoder", "decoder"):
        raise ValueError(f"stack={stack!r}: choose encoder or decoder (seq2seq models), or leave it unset")
    if isinstance(source, PositionScheme):
        return source
    if isinstance(source, nn.Module):
        found = {name: m for name, m in source.named_modules() if isinstance(m, PositionScheme)}
        wanted = [m for name, m in found.items() if stack is None or name.split(".")[0] == stack]
        if not wanted:
            raise ValueError(f"stack={stack!r}: the model's position schemes are {sorted(found)}")
        return wanted[0]
    if not hasattr(source, "position_scheme"):
        raise ValueError(f"expected a plugformer model, config or PositionScheme, got {type(source).__name__}")
    scheme_class = POSITION_SCHEMES.get(source.position_scheme)
    if source.is_encoder_decoder:
        return scheme_class(source, bidirectional=stack != "decoder")
    return scheme_class(source)


def _device(module: nn.Module) -> torch.device:
    return next((t.device for t in (*module.parameters(), *module.buffers())), torch.device("cpu"))


@torch.no_grad()
def position_bias_by_distance(
    source, max_distance: int = 32, *, stack: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bias each head adds to the score of a key at signed distance key − query, from the scheme's `bias()`.

    Args:
        source: a plugformer model, config or [`PositionScheme`] (see [`position_scheme_of`]).
        max_distance (`int`, *optional*, defaults to 32): distances run from `-max_distance` to `max_distance`.
        stack (`str`, *optional*): `encoder` or `decoder` of a seq2seq model.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: the distances `(D,)` and the float32 biases `(heads, D)`. A causal
        scheme's future keys (distance > 0) are masked in the model, so their entries are NaN.
    """
    scheme = position_scheme_of(source, stack)
    if not scheme.has_bias:
        raise ValueError(
            f"position_scheme={scheme.name!r} adds no bias to the attention scores; "
            f"schemes with a bias: {bias_schemes()}"
        )
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 1:
        raise ValueError(f"max_distance={max_distance!r} must be an int >= 1")
    device = _device(scheme)
    distances = torch.arange(-max_distance, max_distance + 1)  # (D,) key − query
    query_slots = torch.tensor([max_distance], device=device)  # (1,): keys 0..2·max lie at −max..max
    key_slots = torch.arange(2 * max_distance + 1, device=device)  # (D,)
    bias = scheme.bias(query_slots, key_slots)[0, :, 0].float().cpu()  # (1, H, 1, D) -> (H, D)
    if not scheme.bidirectional:
        bias[:, distances > 0] = math.nan
    return distances, bias


def plot_position_bias(
    source,
    path: str | Path,
    max_distance: int = 32,
    *,
    stack: str | None = None,
    dpi: int = 100,
    figsize: tuple[float, float] = (8, 4.5),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One line per head: bias against key − query distance ([`position_bias_by_distance`]); ALiBi's title lists
    its slopes.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: the distances and biases drawn.
    """
    plt = pyplot()
    scheme = position_scheme_of(source, stack)
    distances, bias = position_bias_by_distance(scheme, max_distance)
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    for head, values in enumerate(bias):
        ax.plot(distances.numpy(), values.numpy(), label=f"head {head}")
    direction = "bidirectional" if scheme.bidirectional else "causal: future keys masked"
    title = f"{scheme.name} ({direction})"
    slopes = getattr(scheme, "slopes", None)
    if slopes is not None:
        title += "\nslopes " + ", ".join(f"{s:.4g}" for s in slopes.tolist())
    ax.set(xlabel="distance key − query", ylabel="bias added to the score", title=title)
    ax.axvline(0, color="gray", linewidth=0.5)
    ax.legend(fontsize=7, ncol=max(1, len(bias) // 8))
    save_figure(fig, path, dpi)
    return distances, bias


# --- training curves -------------------------------------------------------------------------------------------


def tensorboard_history(run_dir: Path) -> list[dict]:
    """Scalars of every event file under `run_dir/runs`, turned back into Trainer log entries (`train/loss` ->
    `loss`, `eval/loss` -> `eval_loss`); where a step repeats (a resumed run) the later write wins."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    latest: dict[tuple[int, str], tuple[float, float]] = {}  # (step, key) -> (wall time, value)
    for events in sorted((run_dir / "runs").rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(events)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "scalars":
                    continue
                prefix, _, name = value.tag.partition("/")
                key = {"train": name, "eval": f"eval_{name}", "test": f"test_{name}"}.get(prefix, value.tag)
                number = float(tensor_util.make_ndarray(value.tensor))
                if (event.step, key) not in latest or latest[event.step, key][0] <= event.wall_time:
                    latest[event.step, key] = (event.wall_time, number)
    entries: dict[int, dict] = {}
    for (step, key), (_, number) in sorted(latest.items()):
        entries.setdefault(step, {"step": step})[key] = number
    return list(entries.values())


def log_history(run_dir: str | Path) -> tuple[list[dict], Path]:
    """The Trainer's log history of a run directory and where it was read.

    Looked for in order: `trainer_state.json` in the directory (a checkpoint, or `trainer.save_state()`); the
    tensorboard events under `runs/` (`report_to: tensorboard`, which covers the whole run including the
    evaluation after training); the `trainer_state.json` of the latest `checkpoint-*` (up to its step only).
    plugformer's stages write `trainer_state.json` beside the final model; the other two serve runs that stopped
    early or were trained elsewhere.
    """
    from transformers.trainer_utils import get_last_checkpoint

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    state = run_dir / "trainer_state.json"
    if state.is_file():
        return json.loads(state.read_text())["log_history"], state
    if any((run_dir / "runs").rglob("events.out.tfevents.*")):
        return tensorboard_history(run_dir), run_dir / "runs"
    checkpoint = get_last_checkpoint(str(run_dir))
    if checkpoint is not None and (Path(checkpoint) / "trainer_state.json").is_file():
        state = Path(checkpoint) / "trainer_state.json"
        return json.loads(state.read_text())["log_history"], state
    raise ValueError(
        f"{run_dir} has no training log: expected trainer_state.json, tensorboard events under runs/ (train with "
        "--report_to tensorboard) or a checkpoint-*/trainer_state.json (--save_strategy steps)"
    )


def metric_series(history: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """Steps and values of `metric` in a log history; a repeated step keeps its last value."""
    by_step = {entry["step"]: float(entry[metric]) for entry in history if metric in entry}
    return list(by_step), list(by_step.values())


def training_curves(run_dir: str | Path, metrics: Sequence[str] = ("loss", "eval_loss")) -> dict:
    """`{metric: (steps, values)}` for the `metrics` a run logged (absent ones are left out)."""
    history, _ = log_history(run_dir)
    return {m: series for m in metrics if (series := metric_series(history, m))[0]}


def plot_training_curves(
    run_dirs: Sequence[str | Path],
    path: str | Path,
    metrics: Sequence[str] = ("loss", "eval_loss"),
    *,
    dpi: int = 100,
    figsize: tuple[float, float] = (8, 4.5),
) -> dict[str, dict]:
    """Each run's `metrics` against the step, labelled by directory name; `eval_*` metrics dashed.

    Returns:
        `dict[str, dict]`: per run label, `{metric: (steps, values)}` as drawn.
    """
    if not run_dirs:
        raise ValueError("run_dirs=[]: give at least one run directory")
    curves = {}
    for run_dir in run_dirs:
        name = Path(run_dir).resolve().name
        curves[name if name not in curves else str(run_dir)] = training_curves(run_dir, metrics)
    if not any(curves.values()):
        available = sorted({key for run_dir in run_dirs for entry in log_history(run_dir)[0] for key in entry})
        raise ValueError(f"metrics={list(metrics)}: none was logged; the runs logged {available}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    for color, (name, series) in enumerate(curves.items()):
        for metric, (steps, values) in series.items():
            style = "--" if metric.startswith("eval_") else "-"
            ax.plot(
                steps,
                values,
                style,
                color=f"C{color % 10}",
                marker="." if len(steps) < 30 else None,
                label=f"{name}: {metric}",
            )
    ax.set(xlabel="step", ylabel=" / ".join(metrics), title="training curves")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7)
    save_figure(fig, path, dpi)
    return curves


# --- command line ----------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    from ..runtime.arguments import REPEATED_FLAGS_RULE

    main_parser = argparse.ArgumentParser(
        prog="plugformer plot", description=__doc__.splitlines()[0], allow_abbrev=False, epilog=REPEATED_FLAGS_RULE
    )
    commands = main_parser.add_subparsers(dest="command", required=True)
    rule = {"allow_abbrev": False, "epilog": REPEATED_FLAGS_RULE}
    positions = commands.add_parser("positions", help="score bias per head vs key − query distance", **rule)
    positions.add_argument("--model", required=True, help=f"a saved plugformer model ({', '.join(bias_schemes())})")
    positions.add_argument("--max_distance", type=int, default=32)
    positions.add_argument("--stack", choices=("encoder", "decoder"), default=None, help="of a seq2seq model")
    positions.add_argument("--output", default="position_bias.png")
    sinusoidal = commands.add_parser("sinusoidal", help="the sinusoidal position encoding as a heatmap", **rule)
    sinusoidal.add_argument("--positions", type=int, default=128)
    sinusoidal.add_argument("--dim", type=int, default=64)
    sinusoidal.add_argument("--output", default="sinusoidal.png")
    curves = commands.add_parser("curves", help="loss vs step of one or more training runs", **rule)
    curves.add_argument("run_dirs", nargs="+", help="output directories of training runs")
    curves.add_argument("--metrics", nargs="+", default=["loss", "eval_loss"])
    curves.add_argument("--output", default="training_curves.png")
    for command in (positions, sinusoidal, curves):
        command.add_argument("--dpi", type=int, default=100)
    return main_parser


def main(argv: list[str]) -> Path:
    """`plugformer plot positions|sinusoidal|curves ... --output F.png`; prints and returns the file written."""
    from ..runtime.arguments import check_numbers, merge_repeated_flags

    main_parser = parser()
    subparsers = next(a for a in main_parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if argv and argv[0] in subparsers:  # a repeated option of the subcommand accumulates or is refused
        argv = [argv[0], *merge_repeated_flags(subparsers[argv[0]], list(argv[1:]), f"plugformer plot {argv[0]}", ())]
    args = main_parser.parse_args(argv)
    check_numbers(args)  # --dpi 0, --dpi nan: refused naming the flag, before any work
    if args.command == "positions":
        plot_position_bias(load_model(args.model), args.output, args.max_distance, stack=args.stack, dpi=args.dpi)
    elif args.command == "sinusoidal":
        plot_sinusoidal(args.positions, args.dim, args.output, dpi=args.dpi)
    else:
        plot_training_curves(args.run_dirs, args.output, args.metrics, dpi=args.dpi)
    print(f"wrote {args.output}")
    return Path(args.output)


def plot_comparison(summary: dict, path: Path) -> None:
    """`plugformer compare`'s figure: mean and 95% CI per variant (seeds as dots), the selected variant highlighted."""
    plt = pyplot()
    names = list(summary["variants"])
    figure, axis = plt.subplots(figsize=(9, 1.6 + 0.6 * len(names)))
    for row_index, name in enumerate(names):
        row = summary["variants"][name]
        test, color = row["test"], ("tab:red" if name == summary["best"] else "tab:blue")
        seeds = list(row["test_per_seed"].values())
        axis.scatter(seeds, [row_index] * len(seeds), color="grey", s=12, alpha=0.6, zorder=2)
        error = None if math.isnan(test["low"]) else [[test["mean"] - test["low"]], [test["high"] - test["mean"]]]
        axis.errorbar(test["mean"], row_index, xerr=error, fmt="o", color=color, capsize=4, zorder=3)
        if "versus_best" in row and row["versus_best"]["significant"]:
            axis.annotate("*", (test["mean"], row_index), textcoords="offset points", xytext=(0, 6), ha="center")
    axis.set_yticks(range(len(names)), [name.replace(",", "\n") for name in names], fontsize=8)
    axis.invert_yaxis()
    direction = "higher" if summary["higher_is_better"] else "lower"
    axis.set_xlabel(f"test {summary['metric']} ({direction} is better)")
    axis.set_title(
        "mean and 95% CI over seeds (grey dots: seeds); red: selected on dev; *: significantly different", fontsize=9
    )
    axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
