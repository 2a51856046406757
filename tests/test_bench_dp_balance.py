"""benchmarks/bench_dp_balance.py's lower bound: the busy time shared evenly over the ranks, and with waves
the work done after each arrival shared evenly after it, against hand-computed values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_dp_balance as bench  # noqa: E402


def step(seconds: float, end: float, running: int = 1) -> dict:
    return {
        "seconds": seconds,
        "end": end,
        "running": running,
        "waiting": 0,
        "emitted_tokens": 1,
        "finished": 0,
    }


def test_the_bound_of_work_that_arrived_at_once_is_its_even_share():
    traces = [{"steps": [step(1.0, 101.0), step(2.0, 103.0)]}, {"steps": [step(1.0, 101.0)]}]
    assert bench.balanced_bound(traces, [100.0], t0=100.0, ranks=2) == pytest.approx(2.0)


def test_a_later_wave_bounds_by_its_arrival_plus_the_work_after_it():
    # rank 0 works 0-1 s, then from the wave at 5 s until 9 s; rank 1 idles after 1 s: 4 s of work after the
    # arrival shared by 2 ranks ends at 7 s at best, later than the even share of all the work (3 s)
    traces = [
        {"steps": [step(1.0, 101.0), step(4.0, 109.0)]},
        {"steps": [step(1.0, 101.0), step(0.5, 101.5, running=0) | {"emitted_tokens": 0}]},
    ]
    assert bench.balanced_bound(traces, [100.0, 105.0], t0=100.0, ranks=2) == pytest.approx(7.0)
    # a step that began before the arrival counts only for its part after it
    traces[1]["steps"].append(step(2.0, 106.0))
    assert bench.balanced_bound(traces, [100.0, 105.0], t0=100.0, ranks=2) == pytest.approx(5.0 + 5.0 / 2)
