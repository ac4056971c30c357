"""Pairwise accuracy of a reward model: the fraction of pairs whose chosen answer scores above the rejected one."""

import datasets
import evaluate


class PairwiseAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions: scores of the chosen answers; references: scores of the rejected ones",
            features=datasets.Features(
                {"predictions": datasets.Value("float32"), "references": datasets.Value("float32")}
            ),
        )

    def _compute(self, predictions, references):
        wins = [float(chosen > rejected) for chosen, rejected in zip(predictions, references, strict=True)]
        return {"pairwise_accuracy": sum(wins) / max(len(wins), 1), "wins": int(sum(wins))}
