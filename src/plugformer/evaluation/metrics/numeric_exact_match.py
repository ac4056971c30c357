"""Numeric exact match: the final answer of each prediction (after the last `####`, else its last number) equals
the reference as a number — `-7`, `−7`, `-7.0` and `-14/2` all match `-7`."""

import datasets
import evaluate

from plugformer.evaluation.rewards import exact_match_reward


class NumericExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions: generated solutions (str); references: ground-truth numbers (str)",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        matches = exact_match_reward(predictions, answer=references)
        return {"exact_match": sum(matches) / max(len(matches), 1), "matches": int(sum(matches))}
