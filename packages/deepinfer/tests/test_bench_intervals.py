"""Intervals disturbed by a MoE load-balance flush / EPLB rebalance are dropped, not smoothed over."""

import deepinfer_parallel as par
import pytest
import torch
from deepinfer.bench import FlagCounter, Interval, summarize
from deepinfer.bench.intervals import timed
from deepinfer_parallel.eplb.stats import MoeLoadStats


def test_flagged_intervals_are_excluded_from_every_average():
    # synthetic window: three 0.1 s steps and one 5 s step during which a flush happened
    ivs = [Interval(0.1, 8), Interval(0.1, 8), Interval(5.0, 8, flagged=True), Interval(0.1, 8)]
    w = summarize(ivs)
    assert (w.intervals, w.dropped, w.steps, w.tokens) == (3, 1, 3, 24)
    assert w.seconds == pytest.approx(0.3)
    assert w.steps_per_s == pytest.approx(10.0)  # including the flagged one would give 4 / 5.3
    assert w.tokens_per_s == pytest.approx(80.0)
    # dropping is not smoothing: the result equals the window without that interval at all
    without = summarize([ivs[0], ivs[1], ivs[3]])
    assert (without.seconds, without.tokens, without.steps) == (w.seconds, w.tokens, w.steps)


def test_a_window_with_only_flagged_intervals_is_an_error():
    with pytest.raises(ValueError, match="flagged"):
        summarize([Interval(0.1, 1, flagged=True)])


def test_timed_flags_an_interval_when_an_event_is_marked_inside_it():
    flags = FlagCounter()
    quiet, _ = timed(lambda: None, flags, lambda _: 3)
    noisy, _ = timed(lambda: flags.mark("moe_lb_flush"), flags, lambda _: 3)
    assert not quiet.flagged and noisy.flagged
    assert quiet.tokens == 3 and flags.kinds["moe_lb_flush"] == 1
    unflagged, _ = timed(lambda: None, None, lambda _: 1)  # no hook: nothing is flagged
    assert not unflagged.flagged


def test_moe_load_stats_flushes_flag_exactly_their_steps():
    stats = MoeLoadStats(num_layers=2, interval=3)
    flags = FlagCounter()
    assert flags.watch_all({"model": [stats]}) == 1
    flagged = []
    for _ in range(7):
        iv, _ = timed(lambda: stats.record(torch.ones(2)), flags, lambda _: 1)
        flagged.append(iv.flagged)
    # the statistic is gathered every 3rd recorded step
    assert flagged == [False, False, True, False, False, True, False]
    assert stats.sum_mean == 12.0  # the wrapped flush still ran: 6 steps x 2 layers x 1 token


def test_eplb_state_rebalances_and_flushes_are_both_flagged():
    layout = par.RedundantExpertLayout(num_logical=8, num_redundant=0, ep_size=1, num_layers=1)
    state = par.EplbState(layout, par.EplbConfig(interval=4, window=2), lb_stat_interval=3)
    flags = FlagCounter()
    assert flags.watch_all(state) == 1
    for step in range(1, 11):
        iv, report = timed(lambda: state.step(is_prompt=False), flags, lambda _: 1)
        assert iv.flagged == (step % 3 == 0 or report is not None), step
    assert flags.kinds["moe_lb_flush"] == 3 and flags.kinds["eplb_rebalance"] >= 2
    assert flags.watch(state) and flags.kinds["moe_lb_flush"] == 3  # watching twice does not double-count
    state.load_stats.flush()
    assert flags.kinds["moe_lb_flush"] == 4
