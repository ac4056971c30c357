"""`plugformer compare`: a grid of variants x seeds, trained with the same budget and data by the pipeline's stages,
selected on dev, reported on test with 95% confidence intervals and paired significance tests, plus a plot.

    plugformer compare --grid attention_score=scaled_dot,additive position_scheme=rope,alibi \\
        --seeds 0 1 2 --set max_steps=200 --output_dir outputs/compare

Each grid entry is `KEY=V1,V2,...`; the variants are the cartesian product. A key goes to every stage whose
options include it (`sft.learning_rate=...` names one stage, and wins there over a `learning_rate=...`); a
`PlugformerConfig` field that is not a stage option (e.g. `norm_type`) goes into pretrain's `config_overrides`.
`--set KEY=VALUE` applies to every run (each key once; a grid key replaces it).

A run lives in `<output_dir>/runs/<variant>-<hash>/seed<N>/<stage>`, the hash covering every setting that shapes
it (the stage command lines and the content of their YAML files): re-running the same comparison reuses finished
runs and their scores; changing a setting trains new ones. The variant with the best mean dev score is selected;
each other variant is compared with it on test by a paired bootstrap over test examples (each example's score
averaged over seeds; `--significance ttest` uses a paired t-test over seeds instead). The score: perplexity, exact
match, or with `--stages` ending in classify or nli, accuracy (`--metric`); a seq2seq stage by exact match of its
generated targets or their perplexity. The grid and routing: `experiments/grid.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..data.options import CorpusArguments
from ..evaluation.plots import plot_comparison
from ..evaluation.stats import (
    MIN_BOOTSTRAP_SAMPLES,
    check_significance_options,
    holm,
    mean_interval,
    paired_bootstrap,
    paired_t_test,
)
from ..runtime.arguments import config_path, override_flags, stage_config
from ..runtime.files import write_json_atomic, write_text_atomic
from .grid import HELD_OUT, parse_grid, parse_settings, refuse_controlled, route, variant_name, variants


@dataclass(frozen=True)
class Metric:
    """A score per example: `score` summed over examples and divided by the summed `weight` gives the statistic."""

    name: str
    higher_is_better: bool

    def report(self, statistic: float) -> float:
        """The number shown: perplexity is exp of the per-token loss; exact match is the mean itself."""
        return math.exp(statistic) if self.name == "perplexity" else statistic


METRICS = {
    "perplexity": Metric("perplexity", higher_is_better=False),
    "exact_match": Metric("exact_match", higher_is_better=True),
    "accuracy": Metric("accuracy", higher_is_better=True),  # a classify or nli stage's, on the rows its runs held out
}
SIGNIFICANCE_TESTS = ("bootstrap", "ttest")


@dataclass
class CompareArguments(CorpusArguments):
    output_dir: str = field(default="outputs/compare", metadata={"help": "runs, table, JSON and plot go here"})
    grid: list[str] = field(
        default_factory=lambda: ["attention_score=scaled_dot,additive", "position_scheme=rope,alibi"],
        metadata={
            "help": "KEY=V1,V2,... entries (a repeated --grid adds its entries); the variants are their "
            "cartesian product"
        },
    )
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "training seeds of every variant"})
    stages: list[str] = field(default_factory=lambda: ["pretrain"], metadata={"help": "stages run in order per run"})
    stage_configs: str = field(default="configs/{stage}/tiny.yaml", metadata={"help": "each stage's YAML"})
    set: list[str] = field(
        default_factory=list,
        metadata={
            "help": "KEY=VALUE for every run (a repeated --set adds its entries; each KEY once; a --grid KEY "
            "replaces it; stage.KEY wins over KEY for its stage)"
        },
    )
    metric: str = field(
        default="perplexity",
        metadata={
            "help": "perplexity (lower is better) | exact_match | accuracy (--stages ending with classify or nli); "
            "a seq2seq stage: its targets' perplexity or exact match"
        },
    )
    dev_examples: int = field(default=200, metadata={"help": "dev examples scored for selection"})
    test_examples: int = field(default=300, metadata={"help": "test examples scored once for the report"})
    dataset_seed: int = field(default=0, metadata={"help": "seed of the embedded data (fixes the splits)"})
    significance: str = field(
        default="bootstrap", metadata={"help": "bootstrap (over test examples) | ttest (over seeds)"}
    )
    bootstrap_samples: int = field(default=10_000, metadata={"help": f"resamples, at least {MIN_BOOTSTRAP_SAMPLES}"})
    alpha: float = field(default=0.05, metadata={"help": "significance level in (0, 1), Holm-corrected"})
    max_new_tokens: int = field(default=48, metadata={"help": "tokens a scored answer may take (embedded: 48 at most)"})
    rerun: bool = field(default=False, metadata={"help": "retrain and rescore runs that already finished"})

    def __post_init__(self):
        if self.dataset_name is not None and self.metric == "exact_match":
            raise ValueError(
                f"metric={self.metric!r} scores the embedded arithmetic task's answers; on your corpus "
                f"(--dataset_name {self.dataset_name}) compare scores perplexity, or a classify or nli "
                "stage's accuracy"
            )
        if self.rename_columns and self.dataset_name is None:
            raise ValueError(
                f"--rename_columns {self.rename_columns!r} renames your corpus's columns: give "
                "--dataset_name (a classify, nli or seq2seq stage's own data: --set "
                "<stage>.rename_columns)"
            )
        super().__post_init__()  # the other corpus options (`CorpusArguments`)
        if self.metric not in METRICS:
            raise ValueError(f"metric={self.metric!r}: choose one of {list(METRICS)}")
        if self.significance not in SIGNIFICANCE_TESTS:
            raise ValueError(f"significance={self.significance!r}: choose one of {list(SIGNIFICANCE_TESTS)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={self.seeds}: give at least one seed, each once")
        for name in ("dev_examples", "test_examples"):  # selection is on dev, the report on test (0: KeyError)
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name}={getattr(self, name)}: expected at least 1 (compare selects on dev "
                    "examples and reports on test examples)"
                )
        check_significance_options(self.alpha, self.bootstrap_samples)
        refuse_unscorable_stage(self.stages, self.metric)
        if self.significance == "ttest" and len(self.seeds) < 2:
            raise ValueError(f"significance='ttest' pairs seeds: give at least 2 seeds, got {self.seeds}")


def refuse_unscorable_stage(stages: list[str], metric: str = "perplexity") -> None:
    """Compare scores the last stage: a language model by perplexity or exact match, a classifier (a stage reading
    labelled text, its embedded task scored by classification: classify, nli) by accuracy; a reward classifier has
    neither."""
    from ..data.tasks import TASKS
    from ..training import STAGES

    last = STAGES.get(stages[-1]) if stages else None
    task = TASKS.task_of_format(last.data_format, missing_ok=True) if last is not None else None
    classifier = task is not None and task.scorer == "classification"
    if task is not None and task.scorer == "generated_targets":  # its generated targets, or their perplexity
        if metric == "accuracy":
            raise ValueError(
                f"stages={stages}, metric={metric!r}: a seq2seq stage is scored by exact match of its "
                "generated targets or by their perplexity; accuracy scores a classify stage"
            )
        return
    if last is not None and classifier != (metric == "accuracy"):
        raise ValueError(
            f"stages={stages}, metric={metric!r}: accuracy scores a classifier and a classifier is "
            f"scored by accuracy; end --stages with classify or nli and set --metric accuracy, or score "
            f"{stages[-1]!r} by perplexity or exact match"
        )
    if last is not None and not classifier and last.card.pipeline_tag != "text-generation":
        raise ValueError(
            f"stages={stages}: compare scores the last stage as a language model (perplexity or exact "
            f"match), and {stages[-1]!r} trains a {last.card.pipeline_tag} model; end --stages with a "
            f"policy stage, or score it with `plugformer eval` (pairwise accuracy)"
        )


def run_plan(args: CompareArguments, variant: dict[str, str]) -> tuple[Path, dict[str, list[str]]]:
    """The directory of a variant and the per-stage options of its runs (without seed and paths)."""
    fixed = parse_settings(args.set)
    refuse_controlled(fixed, "--set")
    refuse_controlled(variant, "--grid")
    settings = {**fixed, **variant}  # a key in both: the grid's value (a budget in --set, one of its keys varied)
    options = route(settings, args.stages)
    if args.dataset_name is not None:
        add_corpus_options(args, settings, options)
    configs = {}
    for stage in args.stages:
        # the shipped YAMLs are found from any folder; a missing, unreadable or folder path names the flag
        configs[stage] = config_path(
            stage_config(args.stage_configs, stage), flag=f"--stage_configs {args.stage_configs}"
        )
    fingerprint = {
        "stages": args.stages,
        "options": options,
        "configs": {stage: Path(path).read_text() for stage, path in configs.items()},
        "dataset_seed": args.dataset_seed,
        **({"corpus": args.corpus_key()} if args.dataset_name is not None else {}),
    }
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:10]
    slug = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", variant_name(variant))
    return Path(args.output_dir, "runs", f"{slug}-{digest}"), options


def add_corpus_options(args: CompareArguments, settings: dict[str, str], options: dict[str, list[str]]) -> None:
    """Points the stages that read plain text (pretrain) at the user's corpus, holding out the documents compare
    scores; refuses a run plan where no stage would read it."""
    from ..training import STAGES

    for key, value in settings.items():
        name = key.rpartition(".")[2]
        if name in HELD_OUT:
            raise ValueError(
                f"{key}={value}: on your corpus the documents pretraining holds out are those compare "
                f"scores; set compare's {HELD_OUT[name]} instead"
            )
    readers = [stage for stage in args.stages if STAGES[stage].data_format == "text"]
    if not readers:
        raise ValueError(
            f"--dataset_name {args.dataset_name}: none of stages={args.stages} trains on plain text; include pretrain"
        )
    held_out = ["--dev_examples", str(args.dev_examples), "--test_examples", str(args.test_examples)]
    for stage in readers:
        options[stage] = [*args.corpus_flags(), *held_out, *options[stage]]


def train_run(args: CompareArguments, directory: Path, options: dict[str, list[str]], seed: int) -> Path:
    """Trains the stages of one (variant, seed) run, reusing finished stages; returns the last stage's directory."""
    from ..runtime.run_folders import run_files
    from ..training import STAGES, run_stage

    run_dir = directory / f"seed{seed}"
    for stage in args.stages:
        output = run_dir / stage
        if (output / "run_info.json").exists() and not args.rerun:
            continue
        argv = ["--config", stage_config(args.stage_configs, stage), "--output_dir", str(output)]
        argv += ["--seed", str(seed), "--dataset_seed", str(args.dataset_seed)]
        argv += ["--exact_match_examples", "0"]  # compare scores dev and test itself (a --set replaces it)
        # the folder is this run's own (same settings hash and seed): an interrupted stage resumes from its newest
        # checkpoint, the remains of one killed before its first checkpoint (or --rerun) are replaced
        if not args.rerun and any(output.glob("checkpoint-*")):
            argv += ["--resume_from_checkpoint", "last"]
        elif run_files(output):
            argv += ["--overwrite_output_dir", "true"]
        parent = STAGES[stage].parent
        if parent is not None:
            if parent not in args.stages:
                raise ValueError(f"stage {stage!r} starts from {parent!r}, which is not in stages={args.stages}")
            argv += ["--model_name_or_path", str(run_dir / parent)]
        for needed in STAGES[stage].inputs:  # rlhf: the run's own stage of the input's default (reward)
            argv += [needed.flag, str(run_dir / needed.default)]
        argv = override_flags(argv, options[stage])  # each flag once: the stage commands refuse a repeat
        print(f"=== {directory.name} seed {seed}: plugformer train {stage} {' '.join(argv)}")
        run_stage(stage, argv)
    return run_dir / args.stages[-1]


# fields that change no per-example score (how scores are compared, where runs live); all others key the score cache
NOT_SCORING = ("output_dir", "grid", "seeds", "significance", "bootstrap_samples", "alpha", "rerun")


def score_key(args: CompareArguments, model_dir: Path, split: str) -> dict:
    """What a run's cached per-example scores depend on: every option of `args` but those in `NOT_SCORING`, the split,
    and the digests of the model scored (`runtime.files.model_sha256`: its weights, config and tokenizer; a model
    retrained, replaced or edited in its folder is scored anew)."""
    from ..runtime.files import model_sha256

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in NOT_SCORING}
    return {"options": options, "split": split, **model_sha256(model_dir)}


def example_scores(args: CompareArguments, model_dir: Path, split: str) -> dict:
    """Per-example scores of a trained run on `split`, cached in `<model_dir>/compare_<metric>_<split>.json` (`score_key`)."""
    size = args.dev_examples if split == "dev" else args.test_examples
    cache = model_dir / f"compare_{args.metric}_{split}.json"
    key = json.loads(json.dumps(score_key(args, model_dir, split), default=str))  # as it reads back from JSON
    if cache.exists() and not args.rerun:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return cached
    scores, weights = _score(args, model_dir, split, size)
    result = {
        "key": key,
        "examples": len(scores),
        "dataset_seed": args.dataset_seed,
        "corpus": args.corpus_key(),
        "scores": scores,
        "weights": weights,
    }
    write_json_atomic(cache, result)
    return result


def _score(args: CompareArguments, model_dir: Path, split: str, size: int) -> tuple[list[float], list[float]]:
    from transformers import AutoModelForCausalLM

    from ..data.sources import load_stage_dataset
    from ..data.tasks import TASKS
    from ..data.tokenization import load_tokenizer
    from ..evaluation.answers import generate_answers
    from ..evaluation.classification import labelled_rows_scores
    from ..evaluation.held_out import recorded_held_out_texts
    from ..evaluation.language_scores import document_losses
    from ..evaluation.rewards import exact_match_reward
    from ..training import STAGES

    tokenizer = load_tokenizer(str(model_dir))
    if TASKS.task_of_format(STAGES[args.stages[-1]].data_format).scorer == "generated_targets":
        return seq2seq_example_scores(args, model_dir, tokenizer, split, size)
    if args.metric == "accuracy":  # 1/0 per held-out row: of the labelled data the run read, or the embedded grammar
        from transformers import AutoModelForSequenceClassification

        rows = own_task_rows(args, model_dir, STAGES[args.stages[-1]].data_format, split, size)
        model = AutoModelForSequenceClassification.from_pretrained(model_dir)
        correct = labelled_rows_scores(model, tokenizer, rows)["correct"]  # text pairs and integer labels as eval's
        return [float(c) for c in correct], [1.0] * len(correct)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if args.metric == "perplexity":
        if args.dataset_name is not None:  # the documents the runs' pretraining held out of your corpus
            texts = recorded_held_out_texts(model_dir, split) or args.held_out_texts(
                split, args.dev_examples, args.test_examples, args.dataset_seed
            )
        else:
            texts = load_stage_dataset("text", sizes={split: size}, seed=args.dataset_seed)[split]["text"]
        losses, counts = document_losses(model, tokenizer, list(texts))
        return losses, [float(c) for c in counts]
    rows = load_stage_dataset("prompt_answer", sizes={split: size}, seed=args.dataset_seed)[split]
    completions = generate_answers(model, tokenizer, list(rows["prompt"]), args.max_new_tokens)
    return exact_match_reward(completions, answer=[str(a) for a in rows["answer"]]), [1.0] * len(completions)


def own_task_rows(args: CompareArguments, model_dir: Path, data_format: str, split: str, size: int):
    """The `split` rows a classify, nli or seq2seq run held out: of the data it read (its run_info.json), else of the
    format's embedded task (the sentiment or inference grammar, the dates): the same rows for every variant and
    seed."""
    from ..data.sources import load_stage_dataset
    from ..evaluation.held_out import held_out_rows, recorded_source

    source = recorded_source(str(model_dir))
    if source is not None:
        return held_out_rows(source, split, size)
    return load_stage_dataset(data_format, sizes={split: size}, seed=args.dataset_seed)[split]


def seq2seq_example_scores(args: CompareArguments, model_dir: Path, tokenizer, split: str, size: int):
    """Per held-out pair of the data the run read (its run_info.json), else of the embedded dates: 1/0 for an exact
    generated target (`exact_match`) or the target's summed loss weighted by its tokens (`perplexity`)."""
    from transformers import AutoModelForSeq2SeqLM

    from ..evaluation.seq2seq import generate_targets, saved_budget, target_losses

    rows = own_task_rows(args, model_dir, "source_target", split, size)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    budget = saved_budget(model, args.max_new_tokens)  # as plugformer eval scores it
    if args.metric == "perplexity":
        losses, counts = target_losses(
            model,
            tokenizer,
            rows,
            max_source_length=budget["max_source_length"],
            max_target_length=budget["max_target_length"],
        )
        return losses, [float(c) for c in counts]
    generated = generate_targets(
        model,
        tokenizer,
        list(rows["source"]),
        budget["max_new_tokens"],
        num_beams=budget["num_beams"],
        max_source_length=budget["max_source_length"],
    )
    references = [str(target).strip() for target in rows["target"]]
    return [float(g == r) for g, r in zip(generated, references, strict=True)], [1.0] * len(references)


def statistic(scores: dict) -> float:
    return sum(scores["scores"]) / sum(scores["weights"])


def summarize(args: CompareArguments, results: dict[str, dict[int, dict[str, dict]]]) -> dict:
    """Per variant: dev mean (selection), test mean ± CI over seeds; the dev-selected best variant against each
    other on test, Holm-corrected. `results[variant][seed][split]` holds `example_scores` outputs."""
    metric = METRICS[args.metric]
    sign = 1 if metric.higher_is_better else -1
    rows = {}
    for name, by_seed in results.items():
        dev = [statistic(by_seed[s]["dev"]) for s in args.seeds]
        test = [statistic(by_seed[s]["test"]) for s in args.seeds]
        shown = [metric.report(value) for value in test]
        rows[name] = {
            "dev": sum(metric.report(value) for value in dev) / len(dev),
            "dev_statistic": sum(dev) / len(dev),
            "test": mean_interval(shown).to_dict(),
            "test_per_seed": dict(zip(args.seeds, shown, strict=True)),
        }
    best = max(rows, key=lambda name: sign * rows[name]["dev_statistic"])
    tests = {name: _paired_test(args, results[best], results[name]) for name in rows if name != best}
    for name, adjusted in holm(tests).items():
        rows[name]["versus_best"] = {**tests[name].to_dict(), "p_holm": adjusted, "significant": adjusted < args.alpha}
    return {"metric": metric.name, "higher_is_better": metric.higher_is_better, "best": best, "variants": rows}


def _paired_test(args: CompareArguments, best: dict[int, dict], other: dict[int, dict]):
    """best − other, paired by test example (scores averaged over seeds) or by seed."""
    if args.significance == "ttest":
        return paired_t_test(
            [statistic(best[s]["test"]) for s in args.seeds], [statistic(other[s]["test"]) for s in args.seeds]
        )
    weights = best[args.seeds[0]]["test"]["weights"]
    for by_seed in (best, other):
        if any(by_seed[s]["test"]["weights"] != weights for s in args.seeds):
            raise ValueError(
                "the variants tokenise the test set differently, so per-token losses are not paired; "
                "compare with --significance ttest or keep the tokenizer fixed"
            )

    def averaged(by_seed):  # (examples,) mean over seeds
        return [sum(by_seed[s]["test"]["scores"][i] for s in args.seeds) / len(args.seeds) for i in range(len(weights))]

    return paired_bootstrap(averaged(best), averaged(other), weights=weights, samples=args.bootstrap_samples)


def table(args: CompareArguments, summary: dict) -> str:
    metric = summary["metric"]
    direction = "higher" if summary["higher_is_better"] else "lower"
    method = "paired bootstrap over test examples" if args.significance == "bootstrap" else "paired t-test over seeds"
    lines = [
        f"{metric} ({direction} is better); {len(args.seeds)} seeds {args.seeds}; best selected on dev "
        f"({args.dev_examples} examples), reported on test ({args.test_examples}); "
        f"significance: {method}, Holm-corrected, alpha {args.alpha}",
        "",
        f"| variant | dev {metric} | test {metric}: mean ± 95% CI | per seed | difference vs best [95% CI] | p (Holm) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in summary["variants"].items():
        test = row["test"]
        spread = "" if math.isnan(test["low"]) else f" ± {(test['high'] - test['low']) / 2:.3f}"
        seeds = ", ".join(f"{value:.3f}" for value in row["test_per_seed"].values())
        if name == summary["best"]:
            versus, p_value, label = "— (selected on dev)", "—", f"**{name}**"
        else:
            v = row["versus_best"]
            versus = f"{v['difference']:+.4f} [{v['low']:+.4f}, {v['high']:+.4f}]"
            p_value, label = f"{v['p_holm']:.3g}" + (" *" if v["significant"] else ""), name
        lines.append(f"| {label} | {row['dev']:.3f} | {test['mean']:.3f}{spread} | {seeds} | {versus} | {p_value} |")
    lines.append("")
    unit = ("per-token loss (nats)" if metric == "perplexity" else metric.replace("_", " ")) + ", best − other"
    lines.append(f"difference: {unit}; * = significant after Holm correction")
    return "\n".join(lines)


def run(args: CompareArguments) -> dict:
    grid = variants(parse_grid(args.grid))
    plans = {variant_name(variant): run_plan(args, variant) for variant in grid}  # validates before training
    results = {}
    for name, (directory, options) in plans.items():
        results[name] = {}
        for seed in args.seeds:
            model_dir = train_run(args, directory, options, seed)
            results[name][seed] = {split: example_scores(args, model_dir, split) for split in ("dev", "test")}
    summary = summarize(args, results)
    summary["runs"] = {name: str(directory) for name, (directory, _) in plans.items()}
    write_results(args, summary, table(args, summary), plot_comparison)
    return summary


def write_results(args, summary: dict, text: str, plot_summary) -> None:
    """`results.md` (the table), `results.json` (arguments, summary and what it ran on: `runtime.environment`) and
    `results.png` in `args.output_dir`."""
    from ..runtime.environment import environment_record

    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output / "results.md", text + "\n")
    record = {"arguments": dataclasses.asdict(args), **summary, "environment": environment_record(world_size=1)}
    write_json_atomic(output / "results.json", record, indent=2)
    plot_summary(summary, output / "results.png")
    print("\n" + text + f"\n\nwritten: {output / 'results.md'}, results.json, results.png")


def main(argv: list[str]) -> dict:
    from ..runtime.arguments import parse_arguments

    return run(parse_arguments(CompareArguments, argv, prog="plugformer compare"))
