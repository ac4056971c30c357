"""chrF (Popović 2015): the character n-gram F-score of hypotheses against references, as sacreBLEU reports it.

Whitespace is removed; for each order n = 1..6 the hypothesis and reference n-grams and their matches (the smaller
count of each shared n-gram) are summed over the corpus; precision and recall are averaged over the orders where
both sides have n-grams, and combined as F-beta with beta = 2 (recall weighs twice), times 100. As in sacreBLEU, a
hypothesis's n-grams of an order its reference has none of (a reference too short) are not counted.
"""

from __future__ import annotations

from collections import Counter

import datasets
import evaluate


ORDER = 6
BETA = 2.0


def char_ngrams(text: str, n: int) -> Counter:
    """The character n-grams of `text` with its whitespace removed.

    >>> sorted(char_ngrams("ab a", 2).items())
    [('ab', 1), ('ba', 1)]
    """
    text = "".join(text.split())
    return Counter(text[i : i + n] for i in range(len(text) - n + 1))


def statistics(hypothesis: str, reference: str, order: int = ORDER) -> list[tuple[int, int, int]]:
    """Per order 1..`order`: (hypothesis n-grams, reference n-grams, matched n-grams); the hypothesis's count is 0
    where the reference has no n-gram of the order.

    >>> statistics("abcab", "ab", order=3)
    [(5, 2, 2), (4, 1, 1), (0, 0, 0)]
    """
    counts = []
    for n in range(1, order + 1):
        hyp, ref = char_ngrams(hypothesis, n), char_ngrams(reference, n)
        counts.append((sum(hyp.values()) if ref else 0, sum(ref.values()), sum((hyp & ref).values())))
    return counts


def f_score(counts: list[tuple[int, int, int]], beta: float = BETA) -> float:
    """chrF in [0, 100] from summed `statistics`. Below, unigrams match 3 of 4 both ways and bigrams 2 of 3, so
    precision and recall are both (3/4 + 2/3) / 2 and so is F:

    >>> round(f_score(statistics("abcd", "abce", order=2)), 4)
    70.8333
    """
    precisions, recalls = [], []
    for hyp, ref, matched in counts:
        if hyp > 0 and ref > 0:
            precisions.append(matched / hyp)
            recalls.append(matched / ref)
    if not precisions:
        return 0.0
    precision, recall = sum(precisions) / len(precisions), sum(recalls) / len(recalls)
    if precision + recall == 0:
        return 0.0
    return 100 * (1 + beta**2) * precision * recall / (beta**2 * precision + recall)


def corpus_chrf(hypotheses: list[str], references: list[str], order: int = ORDER, beta: float = BETA) -> float:
    """chrF of a corpus: the statistics of every pair summed, then `f_score`."""
    totals = [[0, 0, 0] for _ in range(order)]
    for hypothesis, reference in zip(hypotheses, references, strict=True):
        for total, counts in zip(totals, statistics(hypothesis, reference, order), strict=True):
            for i in range(3):
                total[i] += counts[i]
    return f_score([tuple(total) for total in totals], beta)


class Chrf(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="Maja Popović. chrF: character n-gram F-score for automatic MT evaluation. WMT 2015.",
            inputs_description="predictions: generated texts (str); references: one reference text each (str)",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        return {
            "chrf": corpus_chrf(predictions, references),
            "chrf_per_example": [f_score(statistics(p, r)) for p, r in zip(predictions, references, strict=True)],
        }
