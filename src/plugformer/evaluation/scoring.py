"""`plugformer eval`: a trained stage's held-out scores, written as JSON beside the model. How each kind of model is
scored lives in `evaluators`, the scores of a language model in `language_scores`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..data.tokenization import load_tokenizer
from ..data.validation import refuse_source_options_without_a_source
from ..runtime.environment import environment_record
from ..runtime.files import (
    MODEL_FILES,
    WEIGHT_FILES,
    model_sha256,
    portable_path,
    recorded_path,
    writable_folder_problem,
    write_json_atomic,
)
from .evaluators import EVALUATORS, model_kind, trained_task, user_data_scores
from .held_out import data_source


@dataclass
class EvalArguments:
    model: str = field(default="outputs/pipeline/sft", metadata={"help": "a trained stage's output directory"})
    split: str = field(default="test", metadata={"help": "train | dev | test"})
    examples: int = field(default=300, metadata={"help": "problems of the split to score"})
    dataset_seed: int = field(default=0, metadata={"help": "seed of the embedded data (the pipeline's splits: 0)"})
    direct_answer_fraction: float | None = field(
        default=None,
        metadata={
            "help": "reward model (or a DPO policy's implicit reward): the share of rejected answers that are "
            "bare near misses in the scored pairs (default: the share it was trained with, from its "
            "run_info.json; 0 without one)"
        },
    )
    max_new_tokens: int | None = field(
        default=None,
        metadata={
            "help": "tokens each generated answer may take (default: the budget the model's run scored its dev "
            "answers with, from its run_info.json; 32 without one)"
        },
    )
    batch_size: int = 64
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "score your own data: the split held out of this datasets source (json, csv, text, parquet "
            "with --data_files, a local folder), carved as a stage carves it; default: the source the "
            "model's run trained on (its run_info.json), else the embedded task"
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "the dataset's configuration name"})
    data_files: list[str] | None = field(default=None, metadata={"help": "local files for a builder such as json"})
    rename_columns: str | None = field(
        default=None, metadata={"help": "with --dataset_name: its columns under the names scored, OLD=NEW pairs"}
    )
    dev_examples: int | None = field(
        default=None, metadata={"help": "your own data: dev rows carved from train (default: as the run carved)"}
    )
    test_examples: int | None = field(
        default=None, metadata={"help": "your own data: test rows carved from train (default: as the run carved)"}
    )
    output: str | None = field(
        default=None, metadata={"help": "JSON file of results (default: <model>/eval_<split>.json)"}
    )
    overwrite_output: bool = field(
        default=False,
        metadata={
            "help": "replace --output even if it holds another model's results or a file that is no result of "
            "plugformer eval (by default refused; an earlier result of the same model is replaced)"
        },
    )

    def __post_init__(self):
        refuse_source_options_without_a_source(
            self.dataset_name,
            data_files=self.data_files,
            dataset_config=self.dataset_config,
            rename_columns=self.rename_columns,
        )


def check_model_dir(model: str) -> None:
    """Raises `ValueError` unless `model` is a folder holding a saved model and its tokenizer (a stage's output):
    transformers would otherwise read a missing folder as a Hub id and a folder without a tokenizer as a request
    for sentencepiece."""
    path = Path(model)
    if not path.is_dir():
        raise ValueError(
            f"--model {model}: no such folder; give a trained stage's output directory (e.g. outputs/pipeline/sft)"
        )
    missing = [name for name in ("config.json", "tokenizer_config.json") if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"--model {model} is not a saved model folder (no {' or '.join(missing)}); give a trained "
            "stage's output directory (e.g. outputs/pipeline/sft)"
        )


def with_generation_budget(args: EvalArguments) -> EvalArguments:
    """`args` with `max_new_tokens` set: as given, else the budget the model's run scored its own dev answers with
    (`run_info.json`'s `max_new_tokens`: a shorter one cuts the longest worked answers before their `####` line),
    else 32."""
    if args.max_new_tokens is not None:
        return args
    info = Path(args.model, "run_info.json")
    recorded = json.loads(info.read_text()).get("max_new_tokens") if info.is_file() else None
    return dataclasses.replace(args, max_new_tokens=recorded if isinstance(recorded, int) and recorded > 0 else 32)


def evaluate_directory(args: EvalArguments) -> dict:
    """Scores a stage directory on a split of the embedded task its run trained on (`evaluators.trained_task`), by
    its kind of model (`evaluators.EVALUATORS`): a language model by greedy exact match (with a 95% Wilson
    interval), answer format and perplexity; a reward model (`num_labels=1`) by pairwise accuracy; a masked LM by the
    perplexity and accuracy of its masked tokens; a classifier, and the decomposable attention model, by accuracy and
    macro F1; an encoder-decoder by exact match, chrF and target perplexity. A model trained on your own data (its
    run_info.json), or any model given `--dataset_name`, is scored on that source's held-out split instead
    (`evaluators.user_data_scores`)."""
    from transformers import AutoConfig

    if args.split not in ("train", "dev", "test"):
        raise ValueError(f"split={args.split!r}: choose train, dev or test")
    if isinstance(args.examples, bool) or not isinstance(args.examples, int) or args.examples < 1:
        raise ValueError(
            f"--examples {args.examples!r}: expected an integer >= 1 (problems of the {args.split} split to score)"
        )
    check_model_dir(args.model)
    args = with_generation_budget(args)
    config = AutoConfig.from_pretrained(args.model)
    results = {"model": args.model, "split": args.split, "max_new_tokens": args.max_new_tokens}
    evaluator = EVALUATORS[model_kind(config)]
    source = data_source(args)
    if source is not None:  # your own data: never the embedded task's scores for a model trained on something else
        return {**results, **user_data_scores(args, source, evaluator)}
    task = trained_task(args.model, evaluator)
    return {**results, **evaluator.embedded(args, load_tokenizer(args.model), task)}


# per-example lists (the paired tests read them) and sample answers: in the JSON file, not on the terminal
PER_EXAMPLE = ("samples", "correct", "completion_losses", "completion_tokens", "masked_losses", "masked_counts",
               "chrf_per_example", "target_losses", "target_tokens", "pretraining_format_correct",
               "pretraining_format_samples")  # fmt: skip
# files of a model or a run that an evaluation result must never take the name of (they would read as the model's)
NOT_RESULTS = (*WEIGHT_FILES, *MODEL_FILES, "run_info.json", "trainer_state.json", "training_args.bin")


def results_key(args: EvalArguments, output: Path) -> dict:
    """What an evaluation's results depend on: every option but where they go, the model folder (as `output` records
    it: `runtime.files.portable_path`) and the digests of the model in it (`runtime.files.model_sha256`), and what it
    ran on (`runtime.environment`: another CPU's instruction set rounds otherwise). Written beside the results: a
    reader (or a later evaluation deciding whether it may replace them) sees which model and settings they are of."""
    options = {name: getattr(args, name) for name in args.__dataclass_fields__ if name not in NOT_KEYED}
    environment = environment_record(world_size=1)  # `plugformer eval` runs in one process
    return {
        "options": options,
        "model_dir": portable_path(args.model, output.parent),
        **model_sha256(args.model),
        "environment": environment,
    }


NOT_KEYED = ("model", "output", "overwrite_output")  # the model is keyed by its folder and digests


def output_problem(args: EvalArguments, output: Path) -> str | None:
    """Why writing the results to `output` would fail or destroy something, or `None`: a folder, or a file in a folder
    this process cannot write (found before the scoring, not after it); a name of a model's or a run's files
    (`NOT_RESULTS`); an existing file that is no `plugformer eval` result, or the result of another model folder
    (unless `--overwrite_output true`). An earlier result of the same model folder is replaced: a rerun (other
    settings, or the model retrained in its folder) supersedes it, and the key it writes says which it is."""
    from fnmatch import fnmatch

    if output.is_dir():
        return f"--output {output} is a folder; give the JSON file to write (default: <model>/eval_<split>.json)"
    unwritable = writable_folder_problem(output.parent)
    if unwritable is not None:  # found now, not after all the scoring
        where = "" if args.output else f" (the default, in --model {args.model})"
        return (
            f"--output {output}{where}: {unwritable}, so the results could not be written; give --output "
            "FILE.json in a folder you can write"
        )
    if any(fnmatch(output.name, pattern) for pattern in NOT_RESULTS):
        return (
            f"--output {output}: {output.name} is the name of a model's or a run's own file; results written "
            "there would read as the model's. Choose another file name (default: <model>/eval_<split>.json)"
        )
    if args.overwrite_output or not output.exists():
        return None
    try:
        earlier = json.loads(output.read_text())
    except (OSError, ValueError):
        earlier = None
    if not isinstance(earlier, dict) or not {"model", "split"} <= earlier.keys():
        return (
            f"--output {output} already holds a file that is no result of plugformer eval; choose another "
            "--output, or replace it with --overwrite_output true"
        )
    # recorded relative to the results' folder (`portable_path`); absolute in files of earlier versions
    theirs = recorded_path((earlier.get("key") or {}).get("model_dir") or earlier["model"], output.parent)
    if theirs != Path(args.model).resolve():
        return (
            f"--output {output} holds the results of another model ({theirs}), not of --model {args.model}; "
            "choose another --output, or replace them with --overwrite_output true"
        )
    return None


def main(argv: list[str]) -> dict:
    """`plugformer eval --model DIR [--split test] ...`: prints the scores and writes them as JSON."""
    from ..runtime.arguments import parse_arguments

    args = with_generation_budget(parse_arguments(EvalArguments, argv, prog="plugformer eval"))
    output = Path(args.output or Path(args.model) / f"eval_{args.split}.json")
    problem = output_problem(args, output)  # before any work
    if problem is not None:
        raise ValueError(problem)
    # the model as the results' folder reaches it, not an absolute path naming the user's home (a shared folder)
    model = portable_path(args.model, output.parent)
    results = {**evaluate_directory(args), "model": model, "key": results_key(args, output)}
    write_json_atomic(output, results, indent=2)
    shown = {k: v for k, v in results.items() if k not in PER_EXAMPLE}
    print(json.dumps(shown, indent=2) + f"\nwritten to {output} (with the scores per example)")
    return results
