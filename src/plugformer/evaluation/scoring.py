"""Held-out scores (`plugformer eval`): greedy answers to the prompts of a split, scored by the verifiable rewards;
perplexity, pairwise accuracy, and your own data's held-out split scored by what its columns allow."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

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
from ..runtime.loading import load_checked
from . import seq2seq
from .answers import generate_answers, prompt_text
from .classification import classifier_scores
from .held_out import completion_perplexity, data_source, held_out_rows, prompts_and_completions, rows_digest
from .masked import masked_lm_scores
from .metrics import load_metric
from .pretrained import pretraining_format_scores, trained_on_text
from .rewards import exact_match_reward, format_reward


def exact_match(
    model, tokenizer, rows, max_new_tokens: int = 32, batch_size: int = 64, synced_gpus: bool = False
) -> dict:
    """Exact-match accuracy and answer-format rate of greedy answers on `rows` (`prompt` and `answer` columns).

    Returns:
        `dict`: `exact_match` and `format` (fractions), `examples` (their count), `correct` (1/0 per example, in
        order: the paired tests compare stages on it) and `samples` (the first three prompts with their
        completions).
    """
    prompts, answers = list(rows["prompt"]), list(rows["answer"])
    completions = generate_answers(model, tokenizer, prompts, max_new_tokens, batch_size, synced_gpus=synced_gpus)
    scores = load_metric("numeric_exact_match").compute(predictions=completions, references=[str(a) for a in answers])
    formatted = format_reward(completions)
    return {
        "exact_match": scores["exact_match"],
        "format": sum(formatted) / max(len(formatted), 1),
        "examples": len(completions),
        "correct": [int(c) for c in exact_match_reward(completions, answer=[str(a) for a in answers])],
        "samples": [
            {"prompt": prompt_text(tokenizer, p), "completion": c, "answer": a}
            for p, c, a in list(zip(prompts, completions, answers, strict=True))[:3]
        ],
    }


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate from `samples` draws of which `correct` were right (Chen et al. 2021, eq. 1):
    1 − C(n−c, k) / C(n, k), the chance that k of the n draws, taken without replacement, hold a right one.

    >>> pass_at_k(8, 0, 8), pass_at_k(8, 1, 8), pass_at_k(8, 2, 1)
    (0.0, 1.0, 0.25)
    """
    if not 0 <= correct <= samples or not 1 <= k <= samples:
        raise ValueError(f"pass_at_k: need 0 <= correct ({correct}) <= samples ({samples}) and 1 <= k ({k}) <= samples")
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)


def sampled_pass_at_k(
    model,
    tokenizer,
    rows,
    samples: int = 8,
    ks: tuple[int, ...] = (1, 8),
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    batch_size: int = 64,
) -> dict:
    """pass@k on `rows` (`prompt` and `answer` columns) from `samples` completions per prompt at `temperature`,
    averaged over prompts; the headroom RL has over greedy decoding.

    Returns:
        `dict`: `pass@k` for each k, `samples` and `temperature`, and `examples` (the number of prompts).
    """
    from .rewards import exact_match_reward

    prompts, answers = list(rows["prompt"]), [str(a) for a in rows["answer"]]
    completions = generate_answers(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        max(1, batch_size // samples),
        samples=samples,
        temperature=temperature,
    )
    right = exact_match_reward(completions, answer=[a for a in answers for _ in range(samples)])
    per_prompt = [int(sum(right[i * samples : (i + 1) * samples])) for i in range(len(prompts))]
    results = {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in per_prompt) / max(len(prompts), 1) for k in ks}
    return {**results, "samples": samples, "temperature": temperature, "examples": len(prompts)}


def preference_accuracy(model, tokenizer, rows, batch_size: int = 64) -> float:
    """Fraction of preference pairs (`prompt`, `chosen`, `rejected`) where a reward model scores `chosen` higher."""
    model.eval()

    @torch.no_grad()
    def reward(prompts: list, answers: list) -> list[float]:
        texts = [
            tokenizer.apply_chat_template(prompt + answer, tokenize=False)
            if isinstance(prompt, list)
            else prompt + answer
            for prompt, answer in zip(prompts, answers, strict=True)
        ]
        values = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
            values.append(model(**batch.to(model.device)).logits[:, 0].float().cpu())  # (B, 1) -> (B,)
        return torch.cat(values).tolist()

    return reward_function_accuracy(reward, rows)


def reward_function_accuracy(reward, rows) -> float:
    """Fraction of preference pairs (`prompt`, `chosen`, `rejected`) that a reward function
    (`f(prompts, completions) -> list[float]`, such as `ImplicitReward`) scores `chosen` above `rejected`."""
    prompts = list(rows["prompt"])
    chosen, rejected = reward(prompts, list(rows["chosen"])), reward(prompts, list(rows["rejected"]))
    metric = load_metric("pairwise_accuracy")
    return metric.compute(predictions=chosen, references=rejected)["pairwise_accuracy"]


@torch.no_grad()
def document_losses(model, tokenizer, texts: list[str], batch_size: int = 32) -> tuple[list[float], list[int]]:
    """Each `<bos> text <eos>` document's summed next-token loss (nats) and its number of predicted tokens."""
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    losses, counts = [], []
    try:
        for start in range(0, len(texts), batch_size):
            documents = [tokenizer.bos_token + t + tokenizer.eos_token for t in texts[start : start + batch_size]]
            batch = tokenizer(documents, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            logits = model(**batch).logits[:, :-1].float()  # (B, T-1, V): predictions of tokens 1..T-1
            targets = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), targets, ignore_index=-100, reduction="none"
            )  # (B, T-1), 0 at pads
            losses += loss.sum(dim=1).tolist()
            counts += (targets != -100).sum(dim=1).tolist()
    finally:
        tokenizer.padding_side = side
    return losses, counts


def perplexity(model, tokenizer, texts: list[str], batch_size: int = 32) -> float:
    """exp of the mean next-token loss over every token of `<bos> text <eos>` documents (pads excluded)."""
    losses, counts = document_losses(model, tokenizer, texts, batch_size)
    return math.exp(sum(losses) / max(sum(counts), 1))


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


def trained_direct_fraction(model: str) -> float:
    """The `direct_answer_fraction` of the embedded data a stage directory was trained on (0 when unrecorded)."""
    info = Path(model, "run_info.json")
    record = json.loads(info.read_text()).get("data", {}) if info.is_file() else {}
    return float(record.get("direct_answer_fraction", 0.0))


def scored_pairs(args: EvalArguments):
    """(preference pairs of `args.split`, their share of bare rejected answers): drawn as the scored model's own
    training pairs were (`--direct_answer_fraction` overrides the share its run_info.json records)."""
    from ..data.sources import load_stage_dataset

    fraction = (
        trained_direct_fraction(args.model) if args.direct_answer_fraction is None else args.direct_answer_fraction
    )
    rows = load_stage_dataset(
        "preference", sizes={args.split: args.examples}, seed=args.dataset_seed, direct_fraction=fraction
    )[args.split]
    return rows, fraction


def evaluate_directory(args: EvalArguments) -> dict:
    """Scores a stage directory on a split of the embedded task: a language model by greedy exact match (with a
    95% Wilson interval), answer format and perplexity; a reward model (`num_labels=1`) by pairwise accuracy; a masked
    LM by the perplexity and accuracy of its masked tokens (`masked.masked_token_scores`); a classifier by accuracy
    and macro F1 on the sentiment grammar, the decomposable attention model on the inference grammar
    (`classifier_scores`); an encoder-decoder by exact match, chrF and target
    perplexity on the dates (`seq2seq.directory_scores`). A model trained on your own data (its
    run_info.json), or any model given `--dataset_name`, is scored on that source's held-out split instead
    (`user_data_scores`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..data.sources import load_stage_dataset
    from .implicit_reward import ImplicitReward, ZeroReward, dpo_record
    from .stats import wilson_interval

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
    kind = model_kind(config)
    source = data_source(args)
    if source is not None:  # your own data: never the embedded task's scores for a model trained on something else
        return {**results, **user_data_scores(args, source, kind)}
    tokenizer = load_tokenizer(args.model)
    sizes, seed = {args.split: args.examples}, args.dataset_seed
    if kind == "masked":
        texts = load_stage_dataset("text", sizes=sizes, seed=seed)[args.split]
        return {**results, **masked_lm_scores(args, tokenizer, texts)}
    if kind in CLASSIFIER_DATA:  # the embedded sentiment grammar, or the inference grammar (`data.nli`)
        rows = load_stage_dataset(CLASSIFIER_DATA[kind], sizes=sizes, seed=seed)[args.split]
        return {**results, **classifier_scores(args, tokenizer, rows)}
    if kind == "encoder_decoder":  # the embedded dates (`data.dates`)
        rows = load_stage_dataset("source_target", sizes=sizes, seed=seed)[args.split]
        return {**results, "data_sha256": rows_digest(rows), **seq2seq.directory_scores(args, tokenizer, rows)}
    if kind == "scalar":
        model = load_checked(AutoModelForSequenceClassification, args.model)
        rows, fraction = scored_pairs(args)
        results["pairwise_accuracy"] = preference_accuracy(model, tokenizer, rows, args.batch_size)
        results["examples"], results["direct_answer_fraction"] = len(rows), fraction
        results["data_sha256"] = rows_digest(rows)
        return results
    model = load_checked(AutoModelForCausalLM, args.model)
    rows = load_stage_dataset("prompt_answer", sizes=sizes, seed=seed)[args.split]
    results.update(exact_match(model, tokenizer, rows, args.max_new_tokens, args.batch_size))
    results["data_sha256"] = rows_digest(rows)  # which problems were scored: `plugformer seeds` compares runs on it
    results["exact_match_ci95"] = wilson_interval(round(results["exact_match"] * len(rows)), len(rows))
    if trained_on_text(args.model):  # a pretrained model: also asked as its corpus writes problems
        results.update(pretraining_format_scores(model, tokenizer, rows, args.max_new_tokens, args.batch_size))
    texts = load_stage_dataset("text", sizes=sizes, seed=seed)[args.split]["text"]
    results["perplexity"] = perplexity(model, tokenizer, texts, args.batch_size)
    if dpo_record(args.model) is not None:  # a DPO policy is a reward model too: its implicit reward
        pairs, _ = scored_pairs(args)
        try:
            reward = ImplicitReward.from_dpo_stage(args.model, batch_size=args.batch_size)
        except ZeroReward as error:  # every pair a tie: no accuracy to report, and the reason instead of a 0.0
            results["implicit_reward_pairwise_accuracy"], results["implicit_reward_note"] = None, str(error)
        else:
            results["implicit_reward_pairwise_accuracy"] = reward_function_accuracy(reward, pairs)
    return results


def language_model_scores(model, tokenizer, rows, args) -> dict:
    """Every score the split's columns allow for a causal LM (the table of `user_data_scores`)."""
    from .implicit_reward import ImplicitReward, ZeroReward, dpo_record

    columns, results = set(rows.column_names), {}
    if "text" in columns:
        results["perplexity"] = perplexity(model, tokenizer, list(rows["text"]), args.batch_size)
    if {"prompt", "completion"} <= columns or "messages" in columns:
        results.update(completion_perplexity(model, tokenizer, *prompts_and_completions(rows), args.batch_size))
    if {"prompt", "answer"} <= columns:
        from .stats import wilson_interval

        results.update(exact_match(model, tokenizer, rows, args.max_new_tokens, args.batch_size))
        results["exact_match_ci95"] = wilson_interval(round(results["exact_match"] * len(rows)), len(rows))
    if {"prompt", "chosen", "rejected"} <= columns and dpo_record(args.model) is not None:
        try:
            reward = ImplicitReward.from_dpo_stage(args.model, batch_size=args.batch_size)
        except ZeroReward as error:
            results["implicit_reward_pairwise_accuracy"], results["implicit_reward_note"] = None, str(error)
        else:
            results["implicit_reward_pairwise_accuracy"] = reward_function_accuracy(reward, rows)
    if not results:
        raise ValueError(
            f"the held-out split's columns {sorted(columns)} give a language model nothing to score: "
            "it needs text, prompt + completion, messages, prompt + answer, or (a DPO stage) prompt + "
            "chosen + rejected"
        )
    return results


# the embedded data a classifier kind is scored on: a plugformer classifier the sentiment grammar, the decomposable
# attention model (sentence pairs only) the inference grammar
CLASSIFIER_DATA = {"classifier": "classification", "pair_classifier": "sentence_pair"}


def model_kind(config) -> str:
    """`"scalar"` (a one-score classification head: a reward model), `"classifier"` (`num_labels` > 1),
    `"pair_classifier"` (the decomposable attention model), `"masked"` (a masked LM), `"encoder_decoder"` or
    `"causal"`, from the saved architecture."""
    from ..decomposable import DecomposableAttentionConfig

    architectures = config.architectures or []
    if config.model_type == DecomposableAttentionConfig.model_type:
        return "pair_classifier"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder_decoder"
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return "scalar" if config.num_labels == 1 else "classifier"
    return "masked" if any(name.endswith("ForMaskedLM") for name in architectures) else "causal"


def user_data_scores(args, source: dict, kind: str) -> dict:
    """`plugformer eval` on your own data: the model in `args.model` scored on `args.split` held out of `source`
    (`held_out.held_out_rows`), by what the split's columns allow:

    | columns | a language model is scored by | a reward model by |
    |---|---|---|
    | `text` | perplexity of each document (a masked LM: of its masked tokens) | — |
    | `prompt` + `completion`, or `messages` | perplexity of the completion (the last assistant turn) | — |
    | `prompt` + `answer` | greedy exact match of the final number (the embedded task's rule) | — |
    | `prompt` + `chosen` + `rejected` | a DPO stage: its implicit reward's pairwise accuracy | pairwise accuracy |

    A classifier (`num_labels` > 1) is scored on `text` + `label` (+ `text_pair`): accuracy and macro F1; an
    encoder-decoder on `source` + `target`: exact match and chrF of its generated targets, their perplexity.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    rows = held_out_rows(source, args.split, args.examples)
    tokenizer = load_tokenizer(args.model)
    results = {"data": source, "examples": len(rows), "data_sha256": rows_digest(rows)}
    if {"chosen", "rejected"} <= set(rows.column_names):  # pairs with an implicit prompt, as training read them
        from .implicit_reward import explicit_prompts

        rows = explicit_prompts(rows)
    if kind == "masked":
        return {**results, **masked_lm_scores(args, tokenizer, rows)}
    if kind in CLASSIFIER_DATA:
        return {**results, **classifier_scores(args, tokenizer, rows)}
    if kind == "encoder_decoder":
        return {**results, **seq2seq.directory_scores(args, tokenizer, rows)}
    if kind == "scalar":
        if not {"prompt", "chosen", "rejected"} <= set(rows.column_names):
            raise ValueError(
                f"a reward model is scored on preference pairs; the held-out split has the columns "
                f"{sorted(rows.column_names)}, not chosen and rejected (with a prompt, or with the "
                "prompt implicit in both)"
            )
        model = load_checked(AutoModelForSequenceClassification, args.model)
        return {**results, "pairwise_accuracy": preference_accuracy(model, tokenizer, rows, args.batch_size)}
    model = load_checked(AutoModelForCausalLM, args.model)
    with torch.no_grad():
        return {**results, **language_model_scores(model, tokenizer, rows, args)}


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
