"""How `plugformer eval` scores each kind of model: one `Evaluator` record per model kind (`model_kind`, read from the
saved architecture), in `EVALUATORS`. Each scores a model on the held-out split of the embedded task its run trained
on (`trained_task`), and on the held-out split of your own data by what its columns allow (`user_data_scores`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.tasks import TASKS, EmbeddedTask
from ..data.tokenization import load_tokenizer
from ..runtime.loading import load_checked
from . import seq2seq
from .classification import classifier_scores
from .held_out import completion_perplexity, held_out_rows, prompts_and_completions, rows_digest
from .language_scores import exact_match, perplexity, preference_accuracy, reward_function_accuracy
from .masked import masked_lm_scores
from .pretrained import pretraining_format_scores, trained_on_text
from .stats import wilson_interval


@dataclass(frozen=True, kw_only=True)
class Evaluator:
    """How `plugformer eval` scores one kind of model.

    Args:
        kind (`str`): The model kind (`model_kind`), e.g. `"classifier"`.
        data_format (`str`): The embedded data format it is scored on when its run recorded none (a model saved
            without a run): its task is the one generating that format (`data.tasks`).
        embedded (`Callable`): `embedded(args, tokenizer, task) -> dict`, its scores on the held-out split of the
            embedded task `task` (`args`: `scoring.EvalArguments`).
        user_data (`Callable`): `user_data(args, tokenizer, rows) -> dict`, its scores on held-out rows of your data.
    """

    kind: str
    data_format: str
    embedded: Callable[..., dict]
    user_data: Callable[..., dict]


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


def trained_task(model: str, evaluator: Evaluator) -> EmbeddedTask:
    """The embedded task the run in `model` trained on: the one generating the data format its `run_info.json`
    records, else the one generating the format `evaluator` reads."""
    info = Path(model, "run_info.json")
    recorded = json.loads(info.read_text()).get("data_format") if info.is_file() else None
    task = TASKS.task_of_format(recorded, missing_ok=True) if isinstance(recorded, str) else None
    return task if task is not None else TASKS.task_of_format(evaluator.data_format)


def task_split(task: EmbeddedTask, data_format: str, args, direct_fraction: float = 0.0):
    """The `args.examples` rows of `args.split` of `task` in `data_format`, drawn from `args.dataset_seed`."""
    from datasets import Dataset

    return Dataset.from_list(task.rows(data_format, args.examples, args.split, args.dataset_seed, direct_fraction))


def trained_direct_fraction(model: str) -> float:
    """The `direct_answer_fraction` of the embedded data a stage directory was trained on (0 when unrecorded)."""
    info = Path(model, "run_info.json")
    record = json.loads(info.read_text()).get("data", {}) if info.is_file() else {}
    return float(record.get("direct_answer_fraction", 0.0))


def scored_pairs(args, task: EmbeddedTask):
    """(preference pairs of `args.split`, their share of bare rejected answers): drawn as the scored model's own
    training pairs were (`--direct_answer_fraction` overrides the share its run_info.json records)."""
    fraction = (
        trained_direct_fraction(args.model) if args.direct_answer_fraction is None else args.direct_answer_fraction
    )
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"direct_answer_fraction={fraction!r} must lie in [0, 1]")
    return task_split(task, "preference", args, fraction), fraction


def implicit_reward_scores(args, pairs) -> dict:
    """The DPO policy in `args.model` scored as a reward model: its implicit reward's pairwise accuracy on `pairs`, or
    `None` with the reason where every pair ties (no accuracy to report, rather than a 0.0)."""
    from .implicit_reward import ImplicitReward, ZeroReward

    try:
        reward = ImplicitReward.from_dpo_stage(args.model, batch_size=args.batch_size)
    except ZeroReward as error:
        return {"implicit_reward_pairwise_accuracy": None, "implicit_reward_note": str(error)}
    return {"implicit_reward_pairwise_accuracy": reward_function_accuracy(reward, pairs)}


def generated_answer_scores(args, tokenizer, rows, model=None) -> dict:
    """Greedy exact match of a causal LM's answers on `rows` (`prompt`, `answer`) with its 95% Wilson interval, and
    which rows were scored (`data_sha256`: `plugformer seeds` compares runs on it)."""
    from transformers import AutoModelForCausalLM

    model = model if model is not None else load_checked(AutoModelForCausalLM, args.model)
    results = exact_match(model, tokenizer, rows, args.max_new_tokens, args.batch_size)
    results["data_sha256"] = rows_digest(rows)
    results["exact_match_ci95"] = wilson_interval(round(results["exact_match"] * len(rows)), len(rows))
    return results


def seq2seq_scores(args, tokenizer, rows) -> dict:
    """An encoder-decoder's scores on `rows` (`seq2seq.directory_scores`), with which rows were scored."""
    return {"data_sha256": rows_digest(rows), **seq2seq.directory_scores(args, tokenizer, rows)}


# how a task's held-out rows are scored (`EmbeddedTask.scorer`): `scorer(args, tokenizer, rows) -> dict`
TASK_SCORERS: dict[str, Callable[..., dict]] = {
    "exact_match": generated_answer_scores,
    "classification": classifier_scores,
    "generated_targets": seq2seq_scores,
}


def task_scores(args, tokenizer, task: EmbeddedTask) -> dict:
    """`task`'s held-out rows (its `scored_format`) scored by its scorer (`TASK_SCORERS`)."""
    if task.scorer not in TASK_SCORERS:
        raise ValueError(f"task {task.name!r}: scorer={task.scorer!r} is none of {list(TASK_SCORERS)}")
    return TASK_SCORERS[task.scorer](args, tokenizer, task_split(task, task.scored_format, args))


def causal_embedded(args, tokenizer, task: EmbeddedTask) -> dict:
    """A language model: greedy exact match (with a 95% Wilson interval) and answer format; asked as its corpus
    writes problems too if it was pretrained on text alone; perplexity of the task's text; a DPO policy's implicit
    reward's pairwise accuracy."""
    from transformers import AutoModelForCausalLM

    from .implicit_reward import dpo_record

    model = load_checked(AutoModelForCausalLM, args.model)
    rows = task_split(task, task.scored_format, args)
    results = generated_answer_scores(args, tokenizer, rows, model)
    if trained_on_text(args.model):  # a pretrained model: also asked as its corpus writes problems
        results.update(pretraining_format_scores(model, tokenizer, rows, args.max_new_tokens, args.batch_size))
    if "text" in task.formats:
        texts = task_split(task, "text", args)["text"]
        results["perplexity"] = perplexity(model, tokenizer, texts, args.batch_size)
    if dpo_record(args.model) is not None:  # a DPO policy is a reward model too: its implicit reward
        results.update(implicit_reward_scores(args, scored_pairs(args, task)[0]))
    return results


def reward_model_embedded(args, tokenizer, task: EmbeddedTask) -> dict:
    """A reward model (`num_labels=1`): pairwise accuracy on the task's preference pairs."""
    from transformers import AutoModelForSequenceClassification

    model = load_checked(AutoModelForSequenceClassification, args.model)
    rows, fraction = scored_pairs(args, task)
    return {
        "pairwise_accuracy": preference_accuracy(model, tokenizer, rows, args.batch_size),
        "examples": len(rows),
        "direct_answer_fraction": fraction,
        "data_sha256": rows_digest(rows),
    }


def masked_embedded(args, tokenizer, task: EmbeddedTask) -> dict:
    """A masked LM: the perplexity and accuracy of its masked tokens in the task's text."""
    return masked_lm_scores(args, tokenizer, task_split(task, "text", args))


def language_model_scores(model, tokenizer, rows, args) -> dict:
    """Every score the split's columns allow for a causal LM (the table of `user_data_scores`)."""
    from .implicit_reward import dpo_record

    columns, results = set(rows.column_names), {}
    if "text" in columns:
        results["perplexity"] = perplexity(model, tokenizer, list(rows["text"]), args.batch_size)
    if {"prompt", "completion"} <= columns or "messages" in columns:
        results.update(completion_perplexity(model, tokenizer, *prompts_and_completions(rows), args.batch_size))
    if {"prompt", "answer"} <= columns:
        results.update(exact_match(model, tokenizer, rows, args.max_new_tokens, args.batch_size))
        results["exact_match_ci95"] = wilson_interval(round(results["exact_match"] * len(rows)), len(rows))
    if {"prompt", "chosen", "rejected"} <= columns and dpo_record(args.model) is not None:
        results.update(implicit_reward_scores(args, rows))
    if not results:
        raise ValueError(
            f"the held-out split's columns {sorted(columns)} give a language model nothing to score: "
            "it needs text, prompt + completion, messages, prompt + answer, or (a DPO stage) prompt + "
            "chosen + rejected"
        )
    return results


def causal_user_data(args, tokenizer, rows) -> dict:
    from transformers import AutoModelForCausalLM

    model = load_checked(AutoModelForCausalLM, args.model)
    with torch.no_grad():
        return language_model_scores(model, tokenizer, rows, args)


def reward_model_user_data(args, tokenizer, rows) -> dict:
    from transformers import AutoModelForSequenceClassification

    if not {"prompt", "chosen", "rejected"} <= set(rows.column_names):
        raise ValueError(
            f"a reward model is scored on preference pairs; the held-out split has the columns "
            f"{sorted(rows.column_names)}, not chosen and rejected (with a prompt, or with the "
            "prompt implicit in both)"
        )
    model = load_checked(AutoModelForSequenceClassification, args.model)
    return {"pairwise_accuracy": preference_accuracy(model, tokenizer, rows, args.batch_size)}


# each kind of model, the embedded data it reads without a run's record, and how it is scored (`plugformer eval`)
EVALUATORS: dict[str, Evaluator] = {
    evaluator.kind: evaluator
    for evaluator in (
        Evaluator(kind="causal", data_format="prompt_answer", embedded=causal_embedded, user_data=causal_user_data),
        Evaluator(
            kind="scalar", data_format="preference", embedded=reward_model_embedded, user_data=reward_model_user_data
        ),
        Evaluator(kind="masked", data_format="text", embedded=masked_embedded, user_data=masked_lm_scores),
        Evaluator(kind="classifier", data_format="classification", embedded=task_scores, user_data=classifier_scores),
        Evaluator(
            kind="pair_classifier", data_format="sentence_pair", embedded=task_scores, user_data=classifier_scores
        ),
        Evaluator(
            kind="encoder_decoder",
            data_format="source_target",
            embedded=task_scores,
            user_data=seq2seq.directory_scores,
        ),
    )
}


def user_data_scores(args, source: dict, evaluator: Evaluator) -> dict:
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
    rows = held_out_rows(source, args.split, args.examples)
    tokenizer = load_tokenizer(args.model)
    results = {"data": source, "examples": len(rows), "data_sha256": rows_digest(rows)}
    if {"chosen", "rejected"} <= set(rows.column_names):  # pairs with an implicit prompt, as training read them
        from .implicit_reward import explicit_prompts

        rows = explicit_prompts(rows)
    return {**results, **evaluator.user_data(args, tokenizer, rows)}
