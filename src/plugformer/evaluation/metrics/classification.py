"""Classification scores: accuracy, macro F1 and the F1 and support of each class.

Macro F1 is the unweighted mean of the per-class F1 over the classes that occur in the references or the
predictions (or over `labels` when given); a class with neither true nor predicted examples is left out, and a
0/0 precision or recall counts as 0 (scikit-learn's `zero_division=0`).
"""

import datasets
import evaluate
import numpy as np


def classification_scores(predictions, references, labels=None) -> dict:
    """Accuracy, macro F1, F1 per class and support per class (true examples) of integer class ids.

    >>> scores = classification_scores([0, 1, 1, 0], [0, 1, 0, 0])
    >>> scores["accuracy"], round(scores["macro_f1"], 4), scores["support"]
    (0.75, 0.7333, {0: 3, 1: 1})
    """
    predicted, true = np.asarray(predictions, dtype=np.int64), np.asarray(references, dtype=np.int64)
    if predicted.shape != true.shape:
        raise ValueError(f"{len(predicted)} predictions but {len(true)} references")
    classes = sorted(set(true.tolist()) | set(predicted.tolist())) if labels is None else [int(x) for x in labels]
    f1_per_class, support = {}, {}
    for label in classes:
        true_positives = int(np.sum((predicted == label) & (true == label)))
        predicted_count, true_count = int(np.sum(predicted == label)), int(np.sum(true == label))
        if predicted_count == 0 and true_count == 0:
            continue  # no evidence either way: F1 is undefined, not 0
        precision = true_positives / predicted_count if predicted_count else 0.0
        recall = true_positives / true_count if true_count else 0.0
        f1_per_class[label] = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        support[label] = true_count
    return {
        "accuracy": float(np.mean(predicted == true)) if len(true) else 0.0,
        "macro_f1": float(np.mean(list(f1_per_class.values()))) if f1_per_class else 0.0,
        "f1_per_class": f1_per_class,
        "support": support,
    }


class Classification(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description=(
                "predictions: predicted class ids (int); references: true class ids (int); "
                "labels (optional): the class ids macro F1 averages over"
            ),
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, labels=None):
        return classification_scores(predictions, references, labels=labels)
