"""Scoring a sequence classifier: accuracy with a Wilson 95% interval and macro F1, and the same scores as a
`Trainer(compute_metrics=...)` callback. The scores come from the offline metric `load_metric("classification")`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..runtime.loading import load_checked
from .held_out import rows_digest
from .metrics import load_metric
from .stats import wilson_interval


@torch.no_grad()
def predict_labels(
    model, tokenizer, texts: Sequence[str], batch_size: int = 64, pairs: Sequence[str] | None = None
) -> list[int]:
    """The class id each text's (or text pair's) logits rank first, in padded batches with the model in eval mode
    (restored after)."""
    was_training = model.training
    model.eval()
    predictions = []
    try:
        for start in range(0, len(texts), batch_size):
            second = list(pairs[start : start + batch_size]) if pairs is not None else None
            batch = tokenizer(
                list(texts[start : start + batch_size]), second, padding=True, truncation=True, return_tensors="pt"
            )
            predictions += model(**batch.to(model.device)).logits.argmax(-1).tolist()  # (B, num_labels) -> (B,)
    finally:
        model.train(was_training)
    return predictions


def evaluate_classifier(
    model,
    tokenizer,
    texts: Sequence[str],
    labels: Sequence[int],
    batch_size: int = 64,
    pairs: Sequence[str] | None = None,
) -> dict:
    """Scores a sequence classifier (e.g. [`PlugformerForSequenceClassification`]) on labelled texts.

    Args:
        model (`PreTrainedModel`): Returns `logits` of shape `(batch_size, num_labels)`.
        tokenizer (`PreTrainedTokenizerBase`): With a pad token.
        texts (`Sequence[str]`): The inputs.
        labels (`Sequence[int]`): Their true class ids.
        batch_size (`int`, *optional*, defaults to 64): Texts per forward pass.
        pairs (`Sequence[str]`, *optional*): Second texts of sentence pairs, encoded with each text.

    Returns:
        `dict`: `accuracy`, `macro_f1`, `f1_per_class` and `support` (see `load_metric("classification")`),
        `accuracy_ci95` (the 95% Wilson interval of the accuracy, `[low, high]`), `examples` (their count) and
        `correct` (1/0 per example, in order: paired tests compare models on it).
    """
    if len(texts) != len(labels):
        raise ValueError(f"evaluate_classifier: {len(texts)} texts but {len(labels)} labels")
    if len(texts) == 0:
        raise ValueError("evaluate_classifier: no examples to score")
    predictions = predict_labels(model, tokenizer, texts, batch_size, pairs)
    references = [int(label) for label in labels]
    scores = load_metric("classification").compute(predictions=predictions, references=references)
    correct = [int(p == r) for p, r in zip(predictions, references, strict=True)]
    return {
        **scores,
        "accuracy_ci95": list(wilson_interval(sum(correct), len(references))),
        "examples": len(references),
        "correct": correct,
    }


def compute_metrics(eval_prediction) -> dict:
    """`Trainer(compute_metrics=compute_metrics)`: accuracy and macro F1 of the argmax of the logits.

    >>> from transformers import EvalPrediction
    >>> logits = np.array([[2.0, -1.0], [0.5, 1.5], [0.0, 3.0]])
    >>> compute_metrics(EvalPrediction(predictions=logits, label_ids=np.array([0, 1, 0])))
    {'accuracy': 0.6666666666666666, 'macro_f1': 0.6666666666666666}
    """
    logits = eval_prediction.predictions
    if isinstance(logits, tuple):  # models that also return hidden states or attentions put the logits first
        logits = logits[0]
    scores = load_metric("classification").compute(
        predictions=np.asarray(logits).argmax(-1), references=eval_prediction.label_ids
    )
    return {"accuracy": scores["accuracy"], "macro_f1": scores["macro_f1"]}


def labelled_rows_scores(model, tokenizer, rows, batch_size: int = 64) -> dict:
    """`evaluate_classifier` on labelled `rows` (`text`, `label`, `text_pair` if present), each label read through
    the model's `label2id` (by its text: a csv's integer labels are the class names "0", "1", ...); a label the
    model has no class for is refused."""
    if not {"text", "label"} <= set(rows.column_names):
        raise ValueError(
            f"a classifier is scored on labelled text (columns text and label); the split has the "
            f"columns {sorted(rows.column_names)}"
        )
    label2id = {str(name): index for name, index in model.config.label2id.items()}
    unknown = sorted({str(v) for v in rows["label"]} - label2id.keys())
    if unknown:
        raise ValueError(
            f"the held-out split has labels the model has no class for: {unknown[:5]} (its labels: "
            f"{sorted(label2id)[:20]})"
        )
    pairs = list(rows["text_pair"]) if "text_pair" in rows.column_names else None
    labels = [label2id[str(v)] for v in rows["label"]]
    return evaluate_classifier(model, tokenizer, list(rows["text"]), labels, batch_size, pairs)


def classifier_scores(args, tokenizer, rows) -> dict:
    """`plugformer eval` of the classifier in `args.model` on labelled `rows` (`labelled_rows_scores`): accuracy with
    its 95% Wilson interval, macro F1, per-class F1, 1/0 per row."""
    from transformers import AutoModelForSequenceClassification

    model = load_checked(AutoModelForSequenceClassification, args.model)
    return {"data_sha256": rows_digest(rows), **labelled_rows_scores(model, tokenizer, rows, args.batch_size)}
