"""`plugformer extrapolate`: perplexity as a function of evaluation length for several position schemes trained
on the same data at one length — the setup of the ALiBi paper's Figure 1 (Press et al. 2022).

    plugformer extrapolate --config configs/extrapolation/tiny.yaml

Every scheme is pretrained by the pipeline's `pretrain` stage on contiguous text (positions 0..L-1 across each
block, `document_positions=false`) with `block_size = max_position_embeddings = train_length`. Each model then
reads the same test-token stream cut into non-overlapping windows of each evaluation length (0.5x..8x L by
default); the perplexity is over every token that has a preceding token in its window. A scheme that cannot encode
a length (learned absolute positions past `max_position_embeddings`) is reported as "not supported beyond N" —
asked of the scheme (`PositionScheme.max_length`), not found out by crashing. Training reuses finished runs
exactly as `plugformer compare` does (same run directories and settings hash).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.options import CorpusArguments
from ..evaluation.figures import pyplot
from ..evaluation.stats import mean_interval
from ..runtime.files import model_sha256, write_json_atomic
from ..runtime.loading import load_checked
from .compare import CompareArguments, run_plan, train_run, write_results


# the pretrain options extrapolate sets itself for every run (`training_plan`), and where their values come from
FIXED = {
    "block_size": "from --train_length",
    "max_position_embeddings": "from --train_length",
    "document_positions": "false: positions run 0..L-1 across each block, as at evaluation",
    "position_scheme": "from --position_schemes",
}


MAX_EVAL_LENGTH = 2**20  # tokens of the longest evaluation window: far past any position scheme's training length


@dataclass
class ExtrapolationArguments(CorpusArguments):
    output_dir: str = field(default="outputs/extrapolation", metadata={"help": "runs, table, JSON and plot"})
    position_schemes: list[str] = field(
        default_factory=lambda: ["sinusoidal", "learned", "rope", "alibi", "t5_bias"],
        metadata={"help": "schemes trained and evaluated"},
    )
    train_length: int = field(default=64, metadata={"help": "training sequence length L (= max_position_embeddings)"})
    factors: list[float] = field(
        default_factory=lambda: [0.5, 1.0, 2.0, 4.0, 8.0], metadata={"help": "evaluation lengths as multiples of L"}
    )
    seeds: list[int] = field(default_factory=lambda: [0], metadata={"help": "training seeds per scheme"})
    stage_configs: str = field(default="configs/{stage}/tiny.yaml", metadata={"help": "the pretrain stage's YAML"})
    set: list[str] = field(
        default_factory=list,
        metadata={"help": "KEY=VALUE pretrain options for every scheme (a repeated --set adds its)"},
    )
    eval_windows: int = field(default=8, metadata={"help": "windows of the longest length scored (sets the tokens)"})
    test_examples: int = field(default=2000, metadata={"help": "test documents concatenated into the stream"})
    dataset_seed: int = 0
    batch_size: int = 8
    rerun: bool = field(default=False, metadata={"help": "retrain schemes that already finished"})

    def __post_init__(self):
        super().__post_init__()  # the corpus options (`CorpusArguments`)
        if self.train_length < 2:
            raise ValueError(f"train_length={self.train_length}: expected at least 2 tokens")
        if not self.factors or any(not math.isfinite(f) or f <= 0 for f in self.factors):
            raise ValueError(f"factors={self.factors}: expected positive multiples of train_length")
        if max(self.factors) * self.train_length > MAX_EVAL_LENGTH:  # 1e308 x L ended in an OverflowError traceback
            raise ValueError(
                f"factors={self.factors}: {max(self.factors):g} x train_length {self.train_length} is "
                f"longer than {MAX_EVAL_LENGTH} tokens, the longest evaluation length"
            )
        if self.eval_windows < 1:
            raise ValueError(f"eval_windows={self.eval_windows}: expected at least 1")
        if self.test_examples < 1:  # the perplexity stream is cut from test documents (0 ended in KeyError: 'test')
            raise ValueError(
                f"test_examples={self.test_examples}: expected at least 1 (the evaluation stream is "
                "made of test documents)"
            )
        for entry in self.set:  # `--set block_size=32` replaced --train_length's 64 in the runs the table calls 64
            name = entry.partition("=")[0].strip().rpartition(".")[2]
            if name in FIXED:
                raise ValueError(f"--set {entry}: extrapolate sets {name} itself for every run ({FIXED[name]})")

    def lengths(self) -> list[int]:
        """Evaluation lengths in tokens (at least 2: one to condition on, one to predict)."""
        return sorted({max(2, round(factor * self.train_length)) for factor in self.factors})


def training_plan(args: ExtrapolationArguments) -> CompareArguments:
    """The pretraining runs, as a `compare` grid over `position_scheme` (so runs are shared and reused alike)."""
    length = args.train_length
    fixed = [f"block_size={length}", f"max_position_embeddings={length}", "document_positions=false"]
    return CompareArguments(
        output_dir=args.output_dir,
        grid=[f"position_scheme={','.join(args.position_schemes)}"],
        seeds=args.seeds,
        stages=["pretrain"],
        stage_configs=args.stage_configs,
        set=[*fixed, *args.set],
        dataset_seed=args.dataset_seed,
        test_examples=args.test_examples,
        rerun=args.rerun,
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(CorpusArguments)},
    )


def token_stream(tokenizer, texts: list[str], length: int) -> torch.Tensor:
    """The first `length` tokens of the `<bos> text <eos>` documents concatenated."""
    documents = tokenizer([tokenizer.bos_token + t + tokenizer.eos_token for t in texts], add_special_tokens=False)
    tokens = [token for document in documents["input_ids"] for token in document]
    if len(tokens) < length:
        raise ValueError(
            f"test_examples: the test documents hold {len(tokens)} tokens, {length} are needed; "
            "raise test_examples or lower eval_windows"
        )
    return torch.tensor(tokens[:length])


@torch.no_grad()
def window_perplexity(model, stream: torch.Tensor, length: int, batch_size: int = 8) -> float:
    """Perplexity of `stream` cut into non-overlapping windows of `length` tokens (positions 0..length-1 each)."""
    model.eval()
    windows = stream[: stream.numel() // length * length].view(-1, length)  # (W, length)
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]  # (B, length)
        logits = model(input_ids=batch).logits[:, :-1].float()  # (B, length-1, V): predictions of tokens 1..
        total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="sum").item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


# ExtrapolationArguments fields that do not change one run's perplexities: which runs there are and where they live
NOT_SCORING = ("output_dir", "position_schemes", "seeds", "rerun")


def evaluation_key(args: ExtrapolationArguments, model_dir: Path) -> dict:
    """What a run's cached perplexities depend on: every option but those in `NOT_SCORING`, the lengths and tokens
    scored, and the digests of the model scored (`runtime.files.model_sha256`: its weights, config and tokenizer)."""
    lengths = args.lengths()
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in NOT_SCORING}
    key = {
        "options": options,
        "lengths": lengths,
        "tokens": max(lengths) * args.eval_windows,
        **model_sha256(model_dir),
    }
    return json.loads(json.dumps(key, default=str))  # as it reads back from the cache


def evaluate_run(args: ExtrapolationArguments, model_dir: Path) -> tuple[int | None, dict[int, float | None]]:
    """The scheme's longest encodable length (None: any) and the perplexity per evaluation length (None past that
    length), cached in the run directory."""
    from transformers import AutoModelForCausalLM

    from ..data.sources import load_stage_dataset
    from ..data.tokenization import load_tokenizer
    from ..evaluation.held_out import recorded_held_out_texts
    from ..positions import POSITION_SCHEMES

    lengths = args.lengths()
    cache = model_dir / "extrapolation.json"
    key = evaluation_key(args, model_dir)
    if cache.exists() and not args.rerun:
        cached = json.loads(cache.read_text())
        if cached["key"] == key:
            return cached["limit"], {int(length): value for length, value in cached["perplexity"].items()}
    model = load_checked(AutoModelForCausalLM, model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    if args.dataset_name is not None:  # the documents the runs' pretraining held out of your corpus
        plan = training_plan(args)
        texts = recorded_held_out_texts(model_dir, "test") or args.held_out_texts(
            "test", plan.dev_examples, plan.test_examples, args.dataset_seed
        )
    else:
        texts = load_stage_dataset("text", sizes={"test": args.test_examples}, seed=args.dataset_seed)["test"]["text"]
    stream = token_stream(tokenizer, list(texts), key["tokens"])
    limit = POSITION_SCHEMES.get(model.config.position_scheme).max_length(model.config)
    results = {
        length: None
        if limit is not None and length > limit
        else window_perplexity(model, stream, length, args.batch_size)
        for length in lengths
    }
    write_json_atomic(cache, {"key": key, "limit": limit, "perplexity": results}, indent=2)
    return limit, results


def run(args: ExtrapolationArguments) -> dict:
    plan = training_plan(args)
    summary = {"train_length": args.train_length, "lengths": args.lengths(), "schemes": {}}
    for scheme in args.position_schemes:
        directory, options = run_plan(plan, {"position_scheme": scheme})
        evaluated = [evaluate_run(args, train_run(plan, directory, options, seed)) for seed in args.seeds]
        summary["schemes"][scheme] = {
            "run": str(directory),
            "max_length": evaluated[0][0],
            "perplexity": _combine([results for _, results in evaluated], args.lengths()),
        }
    write_results(args, summary, table(summary, args.seeds), plot)
    return summary


def _combine(per_seed: list[dict[int, float | None]], lengths: list[int]) -> dict[int, dict | None]:
    """Mean and 95% interval over seeds per length; None where the scheme cannot encode it."""
    combined = {}
    for length in lengths:
        values = [result[length] for result in per_seed]
        combined[length] = None if values[0] is None else mean_interval(values).to_dict()
    return combined


def table(summary: dict, seeds: list[int]) -> str:
    train_length, lengths = summary["train_length"], summary["lengths"]
    header = " | ".join(f"{length} ({length / train_length:g}x)" for length in lengths)
    spread = f"mean ± 95% CI over seeds {seeds}" if len(seeds) > 1 else f"seed {seeds[0]}"
    lines = [
        f"test perplexity by evaluation length (trained at {train_length} tokens; {spread}); "
        "non-overlapping windows of the same token stream",
        "",
        f"| position scheme | {header} |",
        "|---|" + "---|" * len(lengths),
    ]
    for scheme, result in summary["schemes"].items():
        cells = []
        for length in lengths:
            value = result["perplexity"][length]
            if value is None:
                cells.append(f"not supported beyond {result['max_length']}")
            elif math.isnan(value["low"]):
                cells.append(f"{value['mean']:.2f}")
            else:
                cells.append(f"{value['mean']:.2f} ± {(value['high'] - value['low']) / 2:.2f}")
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    """Perplexity vs evaluation length (log-log), one line per scheme; the training length dashed."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for scheme, result in summary["schemes"].items():
        points = [(length, value) for length, value in result["perplexity"].items() if value is not None]
        lengths, values = [p[0] for p in points], [p[1]["mean"] for p in points]
        (line,) = axis.plot(lengths, values, marker="o", label=scheme)
        lows, highs = [p[1]["low"] for p in points], [p[1]["high"] for p in points]
        if not any(math.isnan(v) for v in lows):  # several seeds: their 95% interval as a band
            axis.fill_between(lengths, lows, highs, color=line.get_color(), alpha=0.15, linewidth=0)
        if len(points) < len(result["perplexity"]):
            axis.plot(lengths[-1:], values[-1:], marker="x", markersize=12, color=line.get_color(), linestyle="")
            axis.annotate(
                f"{scheme}: not supported\nbeyond {result['max_length']}",
                (lengths[-1], values[-1]),
                textcoords="offset points",
                xytext=(8, 8),
                fontsize=8,
                color=line.get_color(),
            )
    axis.axvline(
        summary["train_length"], color="grey", linestyle="--", label=f"training length {summary['train_length']}"
    )
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(summary["lengths"], [str(length) for length in summary["lengths"]])
    axis.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    axis.yaxis.set_minor_formatter(plt.matplotlib.ticker.FormatStrFormatter("%g"))
    axis.set_xlabel("evaluation length (tokens)")
    axis.set_ylabel("test perplexity (log scale)")
    axis.set_title("length extrapolation (ALiBi paper, Figure 1 setup)")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3, which="both")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str]) -> dict:
    from ..runtime.arguments import parse_arguments

    return run(parse_arguments(ExtrapolationArguments, argv, prog="plugformer extrapolate"))
