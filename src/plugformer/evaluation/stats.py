"""Confidence intervals and paired significance tests for comparing variants.

Two questions, two tools:

- *How well does a variant do?* The mean over seeds with a Student-t 95% interval (`mean_interval`): seeds are the
  repeated experiment, so the interval says how much a re-run could move the mean.
- *Is the best variant really better than another?* Paired tests, because all variants see the same test examples
  and the same seeds: `paired_bootstrap` resamples test examples (each example's score averaged over seeds), in the
  shift form of Berg-Kirkpatrick et al. (2012); `paired_t_test` treats each seed as a pair (few seeds: low power).

The formulas are written out here; scipy only supplies the t distribution (tests check against scipy's own tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


# The fewest resamples `paired_bootstrap` accepts. Its p-value is counted as (1 + extreme) / (1 + samples), so it cannot
# fall below 1 / (1 + samples): 1000 resamples resolve p down to 0.001, what a Holm correction over a handful of
# comparisons at alpha 0.05 needs, and leave 25 resamples in each 2.5% tail of a 95% percentile interval (Efron &
# Tibshirani 1993, ch. 19, ask for about 1000 for percentile intervals). One resample gave a zero-width interval.
MIN_BOOTSTRAP_SAMPLES = 1000


@dataclass(frozen=True)
class Interval:
    """`mean` with a two-sided confidence interval [`low`, `high`] from `n` values (nan bounds when n < 2)."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PairedTest:
    """Result of a paired comparison of A against B: `difference` = statistic(A) − statistic(B)."""

    method: str
    difference: float
    low: float
    high: float
    p_value: float
    n: int

    def significant(self, alpha: float = 0.05) -> bool:
        return self.p_value < alpha

    @property
    def no_spread(self) -> bool:
        """Whether every pair differed by the same amount (a zero-width interval: p is the mean's sign alone)."""
        return self.low == self.high

    def to_dict(self) -> dict:
        return asdict(self)


def _as_vector(values: Sequence[float], name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name}: expected a non-empty 1-d sequence of numbers, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: contains nan or inf")
    return array


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: expected a value strictly between 0 and 1")


def check_significance_options(alpha: float, bootstrap_samples: int | None = None) -> None:
    """Raises `ValueError` naming the option for a significance level outside (0, 1) or fewer bootstrap resamples
    than `MIN_BOOTSTRAP_SAMPLES`: checked before any run trains, not when the table is printed.

    >>> check_significance_options(2.0)
    Traceback (most recent call last):
    ...
    ValueError: --alpha 2.0: expected a significance level strictly between 0 and 1 (e.g. 0.05)
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"--alpha {alpha!r}: expected a significance level strictly between 0 and 1 (e.g. 0.05)")
    if bootstrap_samples is not None and (
        isinstance(bootstrap_samples, bool)
        or not isinstance(bootstrap_samples, int)
        or bootstrap_samples < MIN_BOOTSTRAP_SAMPLES
    ):
        raise ValueError(
            f"--bootstrap_samples {bootstrap_samples!r}: expected an integer of at least "
            f"{MIN_BOOTSTRAP_SAMPLES} (p-values resolve to 1/(1 + samples); fewer give intervals and "
            "p-values too coarse to report)"
        )


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean ± t_{n−1, (1+c)/2} · s/√n, s the sample standard deviation (ddof 1).

    Example:

    >>> interval = mean_interval([1.0, 2.0, 3.0])  # s = 1, t_{2, 0.975} = 4.3027
    >>> round(interval.low, 4), round(interval.high, 4)
    (-0.4841, 4.4841)
    """
    from scipy.stats import t as student_t

    _check_confidence(confidence)
    array = _as_vector(values, "values")
    mean = float(array.mean())
    if array.size < 2:
        return Interval(mean, math.nan, math.nan, 1, confidence)
    half = student_t.ppf((1 + confidence) / 2, array.size - 1) * array.std(ddof=1) / math.sqrt(array.size)
    return Interval(mean, float(mean - half), float(mean + half), int(array.size), confidence)


def paired_t_test(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> PairedTest:
    """Two-sided paired t-test of mean(a − b) = 0, with the t interval of the mean difference.

    `a[i]` and `b[i]` must come from the same pair (here: the same seed). With zero spread (every pair the same
    difference, up to float rounding: exact-match rates k/300 subtract with errors near 1e-16, which gave a
    p-value of 1e-28 for three identical differences of one problem) the test is decided by the mean alone: p = 1 if
    it is 0, else 0; `PairedTest.no_spread` says so, and tables should too.
    """
    from scipy.stats import t as student_t

    first = _as_vector(a, "a")
    differences = first - _paired(b, first)
    n = differences.size
    if n < 2:
        raise ValueError(f"a paired t-test needs at least 2 pairs (seeds), got {n}")
    interval = mean_interval(differences, confidence)
    spread = differences.std(ddof=1)
    if spread <= 1e-12 * max(1.0, abs(interval.mean)):  # float rounding of equal differences
        mean = 0.0 if abs(interval.mean) <= 1e-12 else interval.mean
        interval = Interval(mean, mean, mean, n, confidence)
        p_value = 1.0 if mean == 0 else 0.0
    else:
        statistic = interval.mean / (spread / math.sqrt(n))
        p_value = float(2 * student_t.sf(abs(statistic), n - 1))
    return PairedTest("paired t-test over seeds", interval.mean, interval.low, interval.high, p_value, n)


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    weights: Sequence[float] | None = None,
    samples: int = 10_000,
    seed: int = 0,
    confidence: float = 0.95,
) -> PairedTest:
    """Paired bootstrap over examples of statistic(a) − statistic(b), statistic(x) = Σ x_i / Σ w_i.

    With `weights=None` the statistic is the mean (e.g. exact match from 0/1 scores); for perplexity pass each
    document's summed loss as the score and its token count as the weight, so the statistic is the per-token loss.
    The same resampled examples are used for both systems. The interval is the percentile interval of the resampled
    differences; the two-sided p-value is the share of resampled differences at least as far from the observed one
    as the observed one is from 0 (the bootstrap distribution shifted to the null, Berg-Kirkpatrick et al. 2012),
    counted as (1 + extreme) / (1 + samples) so that it is never reported as exactly 0.
    """
    _check_confidence(confidence)
    first = _as_vector(a, "a")
    second = _paired(b, first)
    weight = np.ones_like(first) if weights is None else _paired(weights, first, name="weights")
    if (weight <= 0).any():
        raise ValueError("weights: every example needs a positive weight (e.g. its token count)")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < MIN_BOOTSTRAP_SAMPLES:
        raise ValueError(
            f"samples={samples!r}: expected at least {MIN_BOOTSTRAP_SAMPLES} bootstrap resamples "
            "(MIN_BOOTSTRAP_SAMPLES: p-values resolve to 1/(1 + samples))"
        )
    observed = first.sum() / weight.sum() - second.sum() / weight.sum()
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, first.size, size=(samples, first.size))  # (samples, n) examples drawn with replacement
    resampled_weight = weight[indices].sum(axis=1)
    differences = (first[indices].sum(axis=1) - second[indices].sum(axis=1)) / resampled_weight  # (samples,)
    tail = (1 - confidence) / 2
    low, high = np.quantile(differences, [tail, 1 - tail])
    # a tolerance so that a difference of exactly 0 is "as extreme" as itself in floating point
    extreme = np.abs(differences - observed) >= abs(observed) - 1e-12
    return PairedTest(
        f"paired bootstrap over examples ({samples} samples)",
        float(observed),
        float(low),
        float(high),
        float((1 + extreme.sum()) / (1 + samples)),
        int(first.size),
    )


def _paired(values: Sequence[float], reference: np.ndarray, name: str = "b") -> np.ndarray:
    array = _as_vector(values, name)
    if array.shape != reference.shape:
        raise ValueError(f"{name}: paired values must have the same length, got {array.size} and {reference.size}")
    return array


def wilson_interval(successes: int, trials: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default).

    Preferred to the normal approximation: it stays inside [0, 1] and keeps its coverage near 0 and 1 and for
    the few hundred examples a small held-out split has.

    Example:

    >>> [round(x, 4) for x in wilson_interval(20, 100)]
    [0.1334, 0.2888]
    """
    if trials <= 0 or not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval: need 0 <= successes ({successes}) <= trials ({trials}) and trials > 0")
    p = successes / trials
    denominator = 1 + z**2 / trials
    centre = (p + z**2 / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z**2 / (4 * trials**2)) / denominator
    # exact at the ends (the formula leaves rounding noise there)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def holm(tests: dict) -> dict[str, float]:
    """Holm-Bonferroni adjusted p-values (step-down, made monotone, capped at 1).

    >>> from types import SimpleNamespace as T
    >>> holm({"a": T(p_value=0.01), "b": T(p_value=0.04), "c": T(p_value=0.03)})
    {'a': 0.03, 'c': 0.06, 'b': 0.06}
    """
    ordered = sorted(tests, key=lambda name: tests[name].p_value)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - rank) * tests[name].p_value))
        adjusted[name] = round(running, 12)
    return adjusted
