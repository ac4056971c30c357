"""Sequence classification: a pretrained model (a masked-LM encoder, BERT-style, or a causal LM reading its last
token) with a new `num_labels`-way head, fine-tuned with transformers' `Trainer` on labelled text.

The data has a `text` column, a `label` column and, for sentence pairs (NLI), a `text_pair` column (encoded
`text <|sep|> text_pair`). Labels are strings or integers; their sorted distinct values in the training split become
the class ids (integers keep their order), saved as the model's `id2label` / `label2id`, so `pipeline(
"text-classification")` answers with the data's own labels. A dev or test label unseen in training is refused. The
dev split is scored after training by accuracy and macro F1; `plugformer eval` scores the test split. The embedded
data is a sentiment grammar ("the food was not really good" -> NEGATIVE, `data.tasks.sentiment`).

A CSV's labels are read as written: `07` and `7` are two classes (pandas read both as the integer 7); labels that are
all integers, no two of them spellings of one, stay integers as before (`user_data.csv_labels`). A parent that is
itself a classifier (a classify run, or the nli stage's model) with another number of labels keeps everything but its
head, which starts anew with a warning naming both label sets (transformers' `ignore_mismatched_sizes`: what
fine-tuning a classifier on a new task means); with the same number, its head is fine-tuned further. The nli stage's
model reads sentence pairs only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..arguments import StageArguments, check_counts, check_trainer_arguments, refuse_bare_answers, refuse_liger_kernel
from ..cards import StageCard
from ..stage_table import Stage, register_stage


logger = logging.getLogger(__name__)


@dataclass
class ClassifyArguments(StageArguments):
    """A sequence classifier fine-tuned on labelled text (`text`, `label`, and `text_pair` for sentence pairs)."""

    max_length: int = field(default=128, metadata={"help": "tokens per text (or pair) at most; longer ones are cut"})
    exact_match_examples: int = field(default=0, metadata={"help": "unused: a classifier generates no answers"})

    def __post_init__(self):
        super().__post_init__()
        check_counts(self, {"max_length": 2})
        refuse_bare_answers(self, "classify")


def label_names(values: list) -> list[str]:
    """The class names of a training split's labels, in class-id order: sorted integers, else sorted strings.

    >>> label_names([2, 0, 2, 1]), label_names(["pos", "neg", "pos"])
    (['0', '1', '2'], ['neg', 'pos'])
    """
    distinct = set(values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in distinct):
        return [str(v) for v in sorted(distinct)]
    if all(isinstance(v, str) for v in distinct):
        return sorted(distinct)
    kinds = sorted({type(v).__name__ for v in distinct})
    raise ValueError(
        f"column 'label' holds {' and '.join(kinds)} values; give every label as an integer or as text "
        "(a float or a list is no class)"
    )


def check_labels(splits, names: list[str]) -> None:
    """Raises `ValueError` naming a dev or test label the training split never has (it has no class id), or a
    training split with one class only."""
    if len(names) < 2:
        raise ValueError(f"the training split has a single label ({names}); a classifier needs at least two")
    for split in ("dev", "test"):
        if split in splits:
            unseen = sorted({str(v) for v in splits[split]["label"]} - set(names))
            if unseen:
                raise ValueError(
                    f"the {split} split has labels the training split never has: {unseen[:5]} "
                    f"(training labels: {names[:20]})"
                )


def label_fields(data) -> dict:
    """The training split's class names (`label_names`; dev and test checked against them, `check_labels`) as a
    classifier's config fields: `num_labels`, `id2label`, `label2id`."""
    names = label_names(list(data["train"]["label"]))
    check_labels(data, names)
    return {
        "num_labels": len(names),
        "id2label": dict(enumerate(names)),
        "label2id": {name: index for index, name in enumerate(names)},
    }


def head_options(path: str, labels: dict, columns: list[str]) -> dict:
    """`from_pretrained` options for a classifier of `labels` (`label_fields`) on the model in `path`, read from its
    config before any weight: a classifier's head of another label count is replaced by a new one
    (`ignore_mismatched_sizes`; transformers refused with a size-mismatch traceback), with a warning naming both label
    sets. Raises `ValueError` when the model is the nli stage's, which reads sentence pairs, and the data (`columns`)
    has no `text_pair`."""
    from transformers import AutoConfig

    from ...decomposable import DecomposableAttentionConfig

    config = AutoConfig.from_pretrained(path)
    if config.model_type == DecomposableAttentionConfig.model_type and "text_pair" not in columns:
        raise ValueError(
            f"--model_name_or_path {path} is the nli stage's decomposable attention model, which reads "
            f"sentence pairs; your data has no text_pair column (it has {columns}): give pairs as text "
            "and text_pair, or start from a language model (a pretrain run)"
        )
    if not any(name.endswith("ForSequenceClassification") for name in config.architectures or ()):
        return {}  # a language model: its classification head is new anyway
    theirs, ours = [str(name) for name in config.id2label.values()], list(labels["id2label"].values())
    if theirs == ours:
        return {}  # the same classes: the head is fine-tuned further
    shown = f"{path} is a classifier of {len(theirs)} labels {theirs[:10]}; your data has {len(ours)}: {ours[:10]}"
    if len(theirs) == len(ours):
        logger.warning(
            "%s: its head is kept and fine-tuned, each of its rows now standing for your label in its place", shown
        )
        return {}
    logger.warning(
        "%s: its head is replaced by a new %d-way head, trained from scratch; the rest is kept", shown, len(ours)
    )
    return {"ignore_mismatched_sizes": True}


def tokenized(split, tokenizer, label2id: dict[str, int], max_length: int):
    """`split` as input ids (pairs joined by the tokenizer's separator) and class-id `labels`."""

    def encode(batch):
        pairs = batch["text_pair"] if "text_pair" in batch else None
        encoded = tokenizer(batch["text"], pairs, truncation=True, max_length=max_length)
        encoded["labels"] = [label2id[str(value)] for value in batch["label"]]
        return encoded

    return split.map(encode, batched=True, remove_columns=split.column_names)


def labelled_trainer(model, tokenizer, data, label2id: dict[str, int], script_args, training_args):
    """transformers' `Trainer` (checkpoints written atomically) on the labelled `train` split, its `dev` split scored
    by accuracy and macro F1 (the classify and nli stages)."""
    from transformers import DataCollatorWithPadding, Trainer

    from ...evaluation.classification import compute_metrics
    from ..checkpoints import atomic_checkpoints

    dev = tokenized(data["dev"], tokenizer, label2id, script_args.max_length) if "dev" in data else None
    return atomic_checkpoints(Trainer)(
        model=model,
        args=training_args,
        train_dataset=tokenized(data["train"], tokenizer, label2id, script_args.max_length),
        eval_dataset=dev,  # test is `plugformer eval`'s, once
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForSequenceClassification

    from ..common import load_model, load_tokenizer, require_model_path, train_and_save, with_adapters
    from ..data import stage_data
    from ..distributed import check_launch, claim_output_dir, log_effective_batch

    check_trainer_arguments(training_args)
    refuse_liger_kernel(training_args)
    check_launch(training_args)
    claim_output_dir(script_args, training_args, "classify")
    data = stage_data(STAGE, script_args)
    labels = label_fields(data)
    path = require_model_path(model_args, "classify")
    tokenizer = load_tokenizer(path)
    options = head_options(path, labels, data["train"].column_names)
    model = load_model(AutoModelForSequenceClassification, model_args, "classify", **labels, **options)
    model.config.pad_token_id = tokenizer.pad_token_id  # the head reads each row's last real token through it
    if model_args.use_peft:
        model = with_adapters(model, model_args, "SEQ_CLS")
    trainer = labelled_trainer(model, tokenizer, data, labels["label2id"], script_args, training_args)
    extra = {"effective_batch": log_effective_batch(trainer, "classify"), "labels": list(labels["id2label"].values())}
    return train_and_save(trainer, STAGE, script_args, tokenizer, extra)


STAGE = register_stage(
    Stage(
        name="classify",
        parent="pretrain",
        script_arguments=ClassifyArguments,
        config_class="TrainingArguments",
        description="sequence classifier on labelled text (Trainer; accuracy, macro F1)",
        data_format="classification",
        data_parallel=True,
        card=StageCard(
            "a sequence classifier fine-tuned on labelled text",
            "Trainer",
            "text-classification",
            embedded_task="sentiment",
        ),
        train=train,
        pipeline_default=False,
    )
)
