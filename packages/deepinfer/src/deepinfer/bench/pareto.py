"""Pareto-front extraction for the benchmark curves."""

from __future__ import annotations

from collections.abc import Sequence


def pareto_front(xs: Sequence[float], ys: Sequence[float], x_higher_is_better: bool) -> list[int]:
    """Indices of the non-dominated points, sorted by x; y (throughput) is always higher-is-better.

    A point is dominated when another is at least as good on both axes and strictly better on one.
    """
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys must have the same length, got {len(xs)} and {len(ys)}")
    sign = 1.0 if x_higher_is_better else -1.0
    front = []
    for i in range(len(xs)):
        xi, yi = sign * xs[i], ys[i]
        dominated = any(
            sign * xs[j] >= xi and ys[j] >= yi and (sign * xs[j] > xi or ys[j] > yi)
            for j in range(len(xs))
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: xs[i])
