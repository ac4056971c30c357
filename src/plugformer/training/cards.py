"""Model cards for trained stages: huggingface_hub's `ModelCard` with model-index metadata, written beside the
weights so the directory documents itself (what it is, how it was trained, how well it does, how to load it)."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..capabilities import KERNELS
from ..data.tasks import TASKS, EmbeddedTask
from ..decomposable import DecomposableAttentionConfig
from ..evaluation.stats import wilson_interval
from ..runtime.environment import environment_text


TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

A `{{ head }}` — {{ summary }} — produced by the `{{ stage }}` stage of plugformer's training pipeline.

| | |
|---|---|
{{ architecture }}

## Training

- stage: `{{ stage }}` ({{ trainer }}{{ loss }}), started from `{{ parent }}`
- data: {{ data }}
- hyperparameters: {{ hyperparameters }}
- {{ world_size }} data-parallel process{{ 'es' if world_size > 1 else '' }}, {{ train_seconds }} s of training{{ machine }}

## Evaluation

{{ evaluation }}

## Intended use and limitations

{{ limitations }}

## How to load

```python
import plugformer  # registers the model type with the Auto classes
from transformers import {{ auto_class }}

model = {{ auto_class }}.from_pretrained("{{ model_path }}")
# without plugformer installed, the code saved beside the weights is used:
model = {{ auto_class }}.from_pretrained("{{ model_path }}", trust_remote_code=True)
```
"""


@dataclass(frozen=True)
class StageCard:
    """What a stage's model card says about it; each stage's record (`plugformer.training.stage_table.Stage`) holds one.

    Args:
        summary (`str`): What the model is, after its head class: "pretrained from scratch on plain text".
        trainer (`str`): The trainer that trained it, e.g. `"trl.SFTTrainer"`.
        pipeline_tag (`str`, *optional*, defaults to `"text-generation"`): The Hub's pipeline tag of the model.
        embedded_task (`str`, *optional*, defaults to `"arithmetic"`): The embedded data it trains on without
            `--dataset_name`, a registered task's name (`plugformer.data.tasks.TASKS`).
    """

    summary: str
    trainer: str
    pipeline_tag: str = "text-generation"
    embedded_task: str = "arithmetic"

    def __post_init__(self):
        TASKS.get_task(self.embedded_task)  # an unknown task is refused when the stage is built, naming the tasks

    @property
    def task(self) -> EmbeddedTask:
        """The record of its embedded task."""
        return TASKS.get_task(self.embedded_task)


# the Auto class that loads a head, where it is not the head's name with Plugformer replaced by AutoModel
AUTO_CLASSES = {
    "PlugformerForConditionalGeneration": "AutoModelForSeq2SeqLM",
    "DecomposableAttentionForSequenceClassification": "AutoModelForSequenceClassification",
}


HYPERPARAMETERS = ("learning_rate", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                   "lr_scheduler_type", "warmup_steps", "weight_decay", "seed", "beta", "num_generations",
                   "max_completion_length", "temperature", "loss_type")  # fmt: skip
# listed only where they differ from transformers' defaults (a recipe that changed them depends on them)
OPTIMIZER_HYPERPARAMETERS = ("optim", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm")


def changed_defaults(training_args, names: tuple[str, ...]) -> dict:
    """The fields `names` of the dataclass `training_args` whose values differ from the class's defaults.

    >>> from transformers import TrainingArguments
    >>> changed_defaults(TrainingArguments(output_dir="x", adam_beta2=0.95), ("adam_beta1", "adam_beta2"))
    {'adam_beta2': 0.95}
    """
    if not is_dataclass(training_args):  # arguments built by hand (a namespace) carry no defaults to differ from
        return {}
    defaults = {field.name: field.default for field in fields(training_args)}
    return {
        name: getattr(training_args, name)
        for name in names
        if name in defaults and getattr(training_args, name) != defaults[name]
    }


LIMITATIONS = (
    "A research model for comparing attention and position variants, trained at small scale on the data named "
    "above; it is not a general assistant and its answers outside that task are not meaningful. "
)
# what the held-out figures of a model trained on your own data mean (an embedded task's record says it for its data)
YOUR_DATA_HELD_OUT = (
    "The figures are on rows held out of that data (dev), never trained on; `plugformer eval` scores its test split."
)


def scored_dataset(info: dict, task: str = "arithmetic", preferences: bool = False) -> dict:
    """The model-index `dataset_type` and `dataset_name` of a stage's dev scores: the source its run recorded
    (`run_info.json`'s `data`), else the embedded `task` (a registered task's name)."""
    data = info.get("data") or {}
    if data.get("dataset_name"):
        files = data.get("data_files")
        named = ", ".join(Path(f).name for f in files) if files else Path(data["dataset_name"]).name
        return {"dataset_type": Path(data["dataset_name"]).name, "dataset_name": named}
    record = TASKS.get_task(task)
    return {
        "dataset_type": record.dataset_type,
        "dataset_name": record.dataset_name + (" preferences" if preferences else ""),
    }


def evaluation_section(info: dict, task: str = "arithmetic") -> tuple[str, list[EvalResult]]:
    """Markdown and model-index entries from a stage's `run_info.json`; `task`: its embedded data's kind."""
    lines, results = [], []
    exact = info.get("dev_exact_match")
    if exact and "chrf" in exact:  # a seq2seq model's generated targets (`evaluation.seq2seq.seq2seq_scores`)
        n, value = exact["examples"], exact["exact_match"]
        low, high = exact["exact_match_ci95"]
        lines.append(
            f"- exact match of the generated targets on {n} dev pairs: **{value:.1%}** (95% Wilson interval "
            f"{low:.1%}–{high:.1%}); chrF {exact['chrf']:.1f}"
        )
        for metric in ("exact_match", "chrf"):
            results.append(
                EvalResult(
                    task_type="text2text-generation",
                    **scored_dataset(info, task),
                    dataset_split="dev",
                    metric_type=metric,
                    metric_value=round(exact[metric], 4),
                )
            )
    elif exact:
        n, value = exact["examples"], exact["exact_match"]
        low, high = wilson_interval(round(value * n), n)
        asked = f" asked as its corpus writes them (`{exact['prompt']!r}`)" if "prompt" in exact else ""
        lines.append(
            f"- greedy exact match on {n} dev problems{asked}: **{value:.1%}** (95% Wilson interval "
            f"{low:.1%}–{high:.1%}); answer format followed: {exact['format']:.1%}"
        )
        results.append(
            EvalResult(
                task_type="text-generation",
                **scored_dataset(info, task),
                dataset_split="dev",
                metric_type="exact_match",
                metric_value=round(value, 4),
            )
        )
    metrics = info.get("metrics", {})
    if "eval_perplexity" in metrics:
        lines.append(f"- dev perplexity: {metrics['eval_perplexity']:.3f}")
        results.append(
            EvalResult(
                task_type="text-generation",
                **scored_dataset(info, task),
                dataset_split="dev",
                metric_type="perplexity",
                metric_value=round(metrics["eval_perplexity"], 4),
            )
        )
    if "eval_macro_f1" in metrics:  # a classifier's (`evaluation.classification.compute_metrics`)
        lines.append(f"- dev accuracy: **{metrics['eval_accuracy']:.1%}**; macro F1: {metrics['eval_macro_f1']:.3f}")
        for metric in ("accuracy", "macro_f1"):
            results.append(
                EvalResult(
                    task_type="text-classification",
                    **scored_dataset(info, task),
                    dataset_split="dev",
                    metric_type=metric,
                    metric_value=round(metrics[f"eval_{metric}"], 4),
                )
            )
    elif "eval_accuracy" in metrics:
        lines.append(f"- dev pairwise accuracy (chosen scored above rejected): {metrics['eval_accuracy']:.1%}")
        results.append(
            EvalResult(
                task_type="text-classification",
                **scored_dataset(info, task, preferences=True),
                dataset_split="dev",
                metric_type="accuracy",
                metric_value=round(metrics["eval_accuracy"], 4),
            )
        )
    return "\n".join(lines) or "No held-out evaluation was run for this stage.", results


def direction(config) -> str:
    if config.is_encoder_decoder:
        return "encoder-decoder"
    return "causal (decoder)" if config.is_causal else "bidirectional (encoder)"


def architecture_rows(model) -> tuple[list[tuple[str, str]], list[str]]:
    """The card's architecture table, (name, value) rows, and its tags: a plugformer model's attention score,
    position scheme, kernel, size and direction; the decomposable attention model's alignment and size."""
    config = model.config
    parameters = f"{sum(p.numel() for p in model.parameters()):,} parameters"
    if config.model_type == DecomposableAttentionConfig.model_type:
        order = (
            f"intra-sentence attention, distances clamped at ±{config.max_intra_distance}"
            if config.intra_attention
            else "none: each sentence is read as a bag of words"
        )
        rows = [
            ("alignment", "e_ij = F(a_i)·F(b_j), softmax over each sentence (attend, compare, aggregate)"),
            ("word order", order),
            ("size", f"{parameters}; embeddings {config.embedding_size}, hidden {config.hidden_size}"),
        ]
        return rows, [f"intra_attention:{str(config.intra_attention).lower()}"]
    rows = [
        ("attention_score", f"`{config.attention_score}`"),
        ("position_scheme", f"`{config.position_scheme}`"),
        ("attn_implementation", f"`{KERNELS.of(config).name}`"),
        (
            "size",
            f"{parameters}; {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} query / {config.num_key_value_heads} key-value heads",
        ),
        ("direction", direction(config)),
    ]
    return rows, [f"attention_score:{config.attention_score}", f"position_scheme:{config.position_scheme}"]


def loss_text(training_args) -> str:
    """`, `dapo` loss, beta 0` for a trainer config with a `loss_type` (TRL's GRPO and DPO; a list: DPO's combined
    losses), `""` without one: the loss a stage trained with is named, not left to a TRL version's default."""
    loss, beta = getattr(training_args, "loss_type", None), getattr(training_args, "beta", None)
    if not loss:
        return ""
    names = " + ".join(f"`{name}`" for name in ([loss] if isinstance(loss, str) else loss))
    return f", {names} loss" + (f", beta {beta:g}" if beta is not None else "")


def rewards_text(info: dict) -> str:
    """`, rewards exact_match_reward x1, my_verifier x0.5 (`verifiers:my_verifier`, sha256 ...)` from `run_info.json`'s
    `rewards` (GRPO: `training.stages.grpo.rewards_record`), `""` without them: your own functions are named on the card."""
    parts = [
        f"{r['name']} x{r['weight']:g}"
        + (
            f" (`{r['spec']}`" + (f", sha256 {r['sha256'][:12]}" if r.get("sha256") else "") + ")"
            if r.get("spec")
            else ""
        )
        for r in info.get("rewards") or []
    ]
    return f", rewards {', '.join(parts)}" if parts else ""


def machine_text(info: dict) -> str:
    """` on AMD EPYC (AVX2), torch 2.13.0 (mkl 2024.2), 1 thread` from `run_info.json`'s `environment` (another
    CPU's instruction set rounds otherwise, so one seed trains otherwise there), `""` where unrecorded."""
    return f" on {environment_text(info['environment'])}" if info.get("environment") else ""


def identity_text(data: dict) -> str:
    """What names your data by content (`run_info.json`'s `data`, `data.identity`): each file's sha256, the held-out
    splits' digests, and the training rows dropped as twins of held-out rows (Duplicates)."""
    files = "; ".join(f"{Path(f['path']).name} sha256 {f['sha256'][:12]}" for f in data.get("files") or [])
    held = ", ".join(
        f"{name} {r['rows']} rows sha256 {r['sha256'][:12]}" for name, r in (data.get("held_out") or {}).items()
    )
    dropped = data.get("duplicates_dropped") or {}
    twins = (
        f"; Duplicates: {', '.join(f'{n} {name}' for name, n in dropped.items())} rows identical to a held-out "
        "row dropped"
        if dropped
        else "; Duplicates: kept (--keep_duplicates)"
        if data.get("keep_duplicates")
        else ""
    )
    return "".join(
        part for part in (f"; files: {files}" if files else "", f"; held out: {held}" if held else "", twins)
    )


def stage_card(
    model, info: dict, training_args, script_args, parent: str | None, model_path: str, card: StageCard
) -> ModelCard:
    """The card of one trained stage (see `TEMPLATE`); `card` is the text its stage record gives."""
    stage = info["stage"]
    rows, tags = architecture_rows(model)
    evaluation, eval_results = evaluation_section(info, card.embedded_task)
    name = Path(model_path).name or "plugformer"
    data = (
        f"`{script_args.dataset_name}`"
        + (f" ({', '.join(script_args.data_files)})" if script_args.data_files else "")
        + identity_text(info.get("data") or {})
        if script_args.dataset_name
        else card.task.card_text
        + (
            f"; {script_args.train_examples:,} training examples"
            if getattr(script_args, "train_examples", None)
            else ""
        )
        + (
            f"; direct_answer_fraction {script_args.direct_answer_fraction}: that share of the answers (the corpus's "
            "problems, SFT answers, or rejected answers of preference pairs) is bare, without the working"
            if script_args.direct_answer_fraction
            else ""
        )
        + ")"
    )
    values = {key: getattr(training_args, key, None) for key in HYPERPARAMETERS}
    values.update(changed_defaults(training_args, OPTIMIZER_HYPERPARAMETERS))
    hyperparameters = ", ".join(
        f"{key}={value.value if isinstance(value, Enum) else value}"
        for key, value in values.items()
        if value is not None
    )
    card_data = ModelCardData(
        library_name="transformers",
        license="apache-2.0",
        model_name=name,
        pipeline_tag=card.pipeline_tag,
        tags=["plugformer", stage, *tags],
        base_model=parent if parent and not Path(parent).exists() else None,
        datasets=[script_args.dataset_name]
        if script_args.dataset_name and not Path(script_args.dataset_name).exists()
        else None,
        eval_results=eval_results or None,
    )
    return ModelCard.from_template(
        card_data,
        template_str=TEMPLATE,
        model_name=name,
        head=type(model).__name__,
        summary=card.summary,
        stage=stage,
        trainer=card.trainer,
        loss=loss_text(training_args) + rewards_text(info),
        parent=parent or "a new model",
        architecture="\n".join(f"| {name} | {value} |" for name, value in rows),
        data=data,
        hyperparameters=hyperparameters,
        world_size=info.get("world_size", 1),
        train_seconds=info.get("train_seconds"),
        machine=machine_text(info),
        evaluation=evaluation,
        limitations=LIMITATIONS + (YOUR_DATA_HELD_OUT if script_args.dataset_name else card.task.held_out),
        auto_class=AUTO_CLASSES.get(type(model).__name__, type(model).__name__.replace("Plugformer", "AutoModel")),
        model_path=model_path,
    )
