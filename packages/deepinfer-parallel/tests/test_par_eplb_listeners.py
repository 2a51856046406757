"""EPLB events reach listeners: every load-statistic flush and every rebalance, once per listener,
with its span on this process's clock (the benchmarks drop the steps they fall in)."""

import time

import deepinfer_parallel as par
import torch
from deepinfer_parallel import MoeLoadStats


def test_load_stats_flush_is_heard_once_per_listener_with_its_span():
    stats = MoeLoadStats(num_layers=2, interval=3)
    heard = []

    def listen(kind, start, end):
        heard.append((kind, start, end))

    stats.add_listener(listen)
    stats.add_listener(listen)  # twice: still heard once
    before = time.perf_counter()
    for _ in range(7):
        stats.record(torch.ones(2))
    after = time.perf_counter()
    assert [k for k, _, _ in heard] == ["moe_lb_flush"] * 2  # steps 3 and 6
    assert all(before <= a <= b <= after for _, a, b in heard)
    assert stats.sum_mean == 12.0  # the flushes themselves ran


def test_eplb_state_reports_rebalances_and_its_load_stat_flushes():
    layout = par.RedundantExpertLayout(num_logical=8, num_redundant=0, ep_size=1, num_layers=1)
    state = par.EplbState(layout, par.EplbConfig(interval=4, window=2), lb_stat_interval=3)
    heard = []
    state.add_listener(lambda kind, a, b: heard.append(kind))
    rebalanced = 0
    for _ in range(10):
        state.expert_count[0, 1] = 5  # some load, so the window is not empty
        rebalanced += state.step(is_prompt=False) is not None
    assert rebalanced >= 2
    assert heard.count("eplb_rebalance") == rebalanced == len(state.reports)
    assert heard.count("moe_lb_flush") == 3
