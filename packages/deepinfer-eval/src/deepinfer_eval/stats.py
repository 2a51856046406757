"""Pass@1 over k samples per task, its 95% interval with tasks as the unit, calibration error.

Samples of one task are correlated (same question), so the interval treats the task as the unit:
either the cluster-robust standard error of the mean, or a bootstrap that resamples tasks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

Z95 = NormalDist().inv_cdf(0.975)


def task_rates(per_task: Sequence[tuple[int, int]]) -> list[float]:
    """correct / k for each (correct, k); k >= 1 and 0 <= correct <= k."""
    rates = []
    for correct, k in per_task:
        if k < 1 or not 0 <= correct <= k:
            raise ValueError(
                f"per-task counts need k >= 1 and 0 <= correct <= k, got correct={correct}, k={k}"
            )
        rates.append(correct / k)
    return rates


def pass_at_1(rates: Sequence[float]) -> float:
    """Mean over tasks of the fraction of correct samples."""
    if not rates:
        raise ValueError("pass@1 needs at least one task")
    return math.fsum(rates) / len(rates)


def clustered_interval(rates: Sequence[float]) -> tuple[float, float] | None:
    """mean +- 1.96 SE with SE^2 = sum (p_i - mean)^2 / (n (n - 1)).

    This is the cluster-robust (tasks as clusters) variance of the pooled mean with the usual
    n / (n - 1) small-sample factor, exact when every task has the same k. Clipped to [0, 1].
    None for fewer than two tasks, where no spread can be estimated.
    """
    n = len(rates)
    if n < 2:
        return None
    mean = pass_at_1(rates)
    se = math.sqrt(math.fsum((p - mean) ** 2 for p in rates) / (n * (n - 1)))
    return max(0.0, mean - Z95 * se), min(1.0, mean + Z95 * se)


def bootstrap_interval(
    rates: Sequence[float], resamples: int = 10_000, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile interval (2.5%, 97.5%) of the mean over ``resamples`` resamplings of the tasks."""
    if resamples < 1:
        raise ValueError(f"bootstrap resamples must be >= 1, got {resamples}")
    if len(rates) < 2:
        return None
    import numpy as np  # lazy: only the bootstrap needs it

    p = np.asarray(rates, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 4_000_000 // len(p))  # bounded memory for thousands of tasks
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = p[rng.integers(0, len(p), size=(stop - start, len(p)))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return float(low), float(high)


def calibration_error(
    confidences: Sequence[float], correct: Sequence[bool], bin_size: int = 100
) -> float | None:
    """RMS calibration error over equal-count bins of samples sorted by confidence (HLE's metric).

    Bins hold ``bin_size`` samples each; the remainder joins the last bin; fewer samples than
    ``bin_size`` make one bin. Each bin weighs by its share of samples.
    """
    if len(confidences) != len(correct):
        raise ValueError("confidences and correct must have the same length")
    if bin_size < 1:
        raise ValueError(f"bin_size must be >= 1, got {bin_size}")
    n = len(confidences)
    if n == 0:
        return None
    pairs = sorted(zip(confidences, correct), key=lambda x: x[0])
    bins = max(1, n // bin_size)
    total = 0.0
    for b in range(bins):
        chunk = pairs[b * bin_size : n if b == bins - 1 else (b + 1) * bin_size]
        gap = math.fsum(c for c, _ in chunk) / len(chunk) - sum(1 for _, ok in chunk if ok) / len(chunk)
        total += len(chunk) / n * gap * gap
    return math.sqrt(total)
