"""Pass@1 and its interval (tasks as the unit) against hand-computed and exact references."""

import math
import random

import numpy as np
import pytest
from deepinfer_eval import bootstrap_interval, calibration_error, clustered_interval, pass_at_1, task_rates


def test_pass_at_1_is_mean_of_per_task_fractions():
    # 3 tasks, k=4: 2/4, 4/4, 0/4 -> mean 0.5 (not the pooled 6/12 by accident: check unequal k too)
    assert pass_at_1(task_rates([(2, 4), (4, 4), (0, 4)])) == 0.5
    # unequal k: mean(1/2, 1/4) = 0.375, whereas pooled 2/6 would be 0.333
    assert pass_at_1(task_rates([(1, 2), (1, 4)])) == 0.375
    with pytest.raises(ValueError, match="correct <= k"):
        task_rates([(5, 4)])
    with pytest.raises(ValueError, match="at least one task"):
        pass_at_1([])


def test_clustered_interval_hand_computed():
    # rates .75 .5 .75 .25 .5: mean .55; sum of squared deviations .175; SE^2 = .175 / (5 * 4)
    low, high = clustered_interval([0.75, 0.5, 0.75, 0.25, 0.5])
    half = 1.959963984540054 * math.sqrt(0.00875)
    assert low == pytest.approx(0.55 - half, abs=1e-12) and high == pytest.approx(0.55 + half, abs=1e-12)
    assert (low, high) == pytest.approx((0.366662, 0.733338), abs=1e-6)
    assert clustered_interval([0.5]) is None  # one task: no spread to estimate
    # rates 0 0 1: mean 1/3, SE 1/3; the lower end would be negative and is clipped to 0
    assert clustered_interval([0.0, 0.0, 1.0]) == pytest.approx((0.0, (1 + 1.959963984540054) / 3), abs=1e-12)


def test_clustered_interval_matches_cluster_robust_variance_of_pooled_mean():
    # Independent reference: CR1 sandwich variance of the pooled sample mean, clusters = tasks.
    rng = random.Random(3)
    k, n = 8, 40
    x = [[rng.random() < rng.random() for _ in range(k)] for _ in range(n)]
    m = sum(map(sum, x)) / (n * k)
    v = n / (n - 1) * sum(sum(xi - m for xi in task) ** 2 for task in x) / (n * k) ** 2
    low, high = clustered_interval([sum(t) / k for t in x])
    assert (low + high) / 2 == pytest.approx(m, abs=1e-12)
    assert (high - low) / 2 == pytest.approx(1.959963984540054 * math.sqrt(v), rel=1e-10)


def _exact_bootstrap_quantiles(rates_q, n):
    """Exact distribution of the resampled mean: n-fold convolution of the empirical pmf."""
    top = max(rates_q)
    pmf1 = np.zeros(top + 1)
    for r in rates_q:
        pmf1[r] += 1 / len(rates_q)
    pmf = np.array([1.0])
    for _ in range(n):
        pmf = np.convolve(pmf, pmf1)
    cdf = np.cumsum(pmf)
    values = np.arange(len(pmf)) / (4 * n)
    return values[np.searchsorted(cdf, 0.025)], values[np.searchsorted(cdf, 0.975)]


def test_bootstrap_interval_matches_exact_resampling_distribution():
    rng = random.Random(7)
    n = 20
    quarters = [rng.randint(0, 4) for _ in range(n)]  # k = 4 samples per task
    low, high = bootstrap_interval([q / 4 for q in quarters], resamples=20_000, seed=1)
    exact_low, exact_high = _exact_bootstrap_quantiles(quarters, n)
    step = 1 / (4 * n)  # the resampled mean lives on this grid
    assert abs(low - exact_low) <= step and abs(high - exact_high) <= step
    assert bootstrap_interval([q / 4 for q in quarters], resamples=20_000, seed=1) == (low, high)  # seeded


def test_calibration_error_hand_computed():
    conf = [0.9, 0.1, 0.8, 0.3, 0.5]
    ok = [True, False, False, True, True]
    # bins of 2 (remainder to the last): {.1 F, .3 T} gap -.3; {.5 T, .8 F, .9 T} gap .7333-.6667
    expected = math.sqrt(2 / 5 * 0.3**2 + 3 / 5 * (2.2 / 3 - 2 / 3) ** 2)
    assert calibration_error(conf, ok, bin_size=2) == pytest.approx(expected, abs=1e-12)
    # fewer samples than a bin: one bin, |mean confidence - accuracy|
    assert calibration_error(conf, ok) == pytest.approx(abs(2.6 / 5 - 3 / 5), abs=1e-12)
    assert calibration_error([1.0, 1.0], [True, True]) == 0.0
    assert calibration_error([], []) is None
