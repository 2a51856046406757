"""Multi-rank rows from the ranks' own step records: events charged to the steps they met, the world's
step as the slowest rank's, the window chosen from the records, and no `dp` without rank processes."""

import os
import socket

import pytest
from deepinfer.bench.rank_steps import (
    decode_window,
    prefill_interval,
    ranks_that_ran,
    window_events,
    world_step,
)
from deepinfer.engine.step_trace import StepTrace

FIELDS = dict(emitted_tokens=2, running=2, waiting=0, decoding=True, finished=0, forwards=1)


def test_sync_loop_event_is_charged_to_the_step_it_met_or_the_next_one():
    trace = StepTrace(async_loop=False)
    trace.restart()
    trace.on_event("moe_lb_flush", 1.2, 1.3)  # inside step [1, 2]
    trace.on_event("eplb_rebalance", 2.1, 2.2)  # between steps: charged to the next
    recs = [
        trace.record(1.0, 2.0, **FIELDS),
        trace.record(2.5, 3.0, **FIELDS),
        trace.record(3.0, 4.0, **FIELDS),
    ]
    assert [r.events for r in recs] == [("moe_lb_flush",), ("eplb_rebalance",), ()]
    assert [r.seconds for r in recs] == [1.0, 0.5, 1.0]
    assert dict(trace.event_counts) == {"moe_lb_flush": 1, "eplb_rebalance": 1}


def test_event_spanning_two_steps_flags_both_and_async_loop_also_flags_the_next():
    sync, asyn = StepTrace(async_loop=False), StepTrace(async_loop=True)
    for trace in (sync, asyn):
        trace.restart()
        trace.on_event("moe_lb_flush", 1.5, 2.5)  # from step 1 into step 2
        trace.on_event("moe_lb_flush", 3.2, 3.4)  # inside step 3
    flagged = {}
    for name, trace in (("sync", sync), ("async", asyn)):
        flagged[name] = [bool(trace.record(t, t + 1.0, **FIELDS).events) for t in (1.0, 2.0, 3.0, 4.0, 5.0)]
    assert flagged["sync"] == [True, True, True, False, False]
    # the model thread's forward after an event is waited for one step later
    assert flagged["async"] == [True, True, True, True, False]


def test_events_are_ignored_while_tracing_is_off_and_take_forgets():
    trace = StepTrace(async_loop=False)
    trace.on_event("moe_lb_flush", 0.0, 0.1)  # before restart(): not heard
    trace.restart()
    trace.record(1.0, 2.0, **FIELDS)
    assert not trace.take()[0]["events"] and trace.take() == []


def _trace(pid, steps, rank=0, ep_ranks=(0, 1), host=None):
    who = {"rank": rank, "pid": pid, "host": host or "elsewhere", "ep_ranks": list(ep_ranks), "eplb": True}
    return {"identity": who, "events": {}, "steps": steps}


def _step(seconds, tokens=2, running=2, events=(), forwards=1, **kw):
    return dict(seconds=seconds, emitted_tokens=tokens, running=running, waiting=kw.get("waiting", 0),
                decoding=kw.get("decoding", True), finished=kw.get("finished", 0), forwards=forwards,
                events=list(events))  # fmt: skip


def test_the_world_step_is_the_slowest_rank_with_every_rank_tokens():
    a = _trace(11, [_step(0.010, forwards=5)], rank=0)
    b = _trace(12, [_step(0.030, tokens=3, events=["moe_lb_flush"], forwards=5)], rank=1)
    iv = world_step([a, b], 0)
    assert (iv.seconds, iv.tokens, iv.batch, iv.flagged) == (0.030, 5, 4, True)
    assert window_events([a, b], range(1)) == {"moe_lb_flush": 1}
    b["steps"][0]["forwards"] = 6  # one rank of the EP group a forward ahead: not the same step
    with pytest.raises(RuntimeError, match="not aligned"):
        world_step([a, b], 0)


def test_decode_window_starts_at_the_full_batch_and_must_stay_full():
    fill = [_step(0.1, running=1, waiting=1, decoding=False), _step(0.1, decoding=False)]
    steady = [_step(0.01, forwards=3 + i) for i in range(5)]
    tail = [_step(0.01, running=1, finished=1, forwards=8)]
    traces = [_trace(21, fill + steady + tail, rank=r) for r in (0, 1)]
    traces[1]["identity"]["pid"] = 22
    assert decode_window(traces, 2, warmup=1, measure=3) == range(3, 6)
    with pytest.raises(RuntimeError, match="raise max_tokens"):
        decode_window(traces, 2, warmup=1, measure=5)
    with pytest.raises(RuntimeError, match="no step ran 3"):
        decode_window(traces, 3, warmup=0, measure=1)


def test_prefill_interval_runs_from_first_work_to_the_finish_on_the_slowest_rank():
    idle = _step(0.5, tokens=0, running=0)
    a = _trace(31, [idle, _step(0.2, tokens=1, running=0, finished=1), idle], rank=0)
    b = _trace(
        32, [idle, _step(0.1, running=1), _step(0.3, running=0, finished=1, events=["eplb_rebalance"])]
    )
    iv, kinds = prefill_interval([a, b], chunk=16)
    assert iv.seconds == pytest.approx(0.4) and iv.tokens == 32 and iv.flagged and kinds == {"eplb_rebalance"}


def test_dp_is_the_number_of_rank_processes_and_never_this_one():
    two = [_trace(41, [_step(0.1)], rank=0), _trace(42, [_step(0.1)], rank=1)]
    ran = ranks_that_ran(two)
    assert ran["dp"] == 2 and ran["rank_pids"] == [41, 42] and ran["eplb_ranks"] == 2
    one_process = [_trace(41, [_step(0.1)], rank=0), _trace(41, [_step(0.1)], rank=1)]
    with pytest.raises(RuntimeError, match="2 rank traces came from 1 processes"):
        ranks_that_ran(one_process)
    here = [_trace(os.getpid(), [_step(0.1)], host=socket.gethostname()), _trace(43, [_step(0.1)], rank=1)]
    with pytest.raises(RuntimeError, match="own process"):
        ranks_that_ran(here)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] sent no step records"):
        ranks_that_ran([two[0], _trace(44, [], rank=1)])
