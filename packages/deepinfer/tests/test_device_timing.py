"""Device busy time / idle gaps between engine steps (engine/device_timing.py).

The bookkeeping is checked on the CPU with an event source whose device timestamps and completion
the test scripts (it behaves like torch.cuda.Event: reading an incomplete event raises), and through
the real engine with host-clock events; on a GPU machine the engine's CUDA events are checked for both
loops (gaps finite and >= 0, the async loop's median gap not above the sync loop's by more than 1.5x).
"""

import math
import statistics
import time

import numpy as np
import pytest
import torch
from deepinfer import LLM, SamplingParams
from deepinfer.engine.device_timing import (
    DeviceTimeline,
    HostClockEvents,
    StepTiming,
    device_timeline,
    summarize_timings,
)

PROMPTS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9]]


class ScriptedEvent:
    def __init__(self, t: float) -> None:
        self.t = t  # device time (s) at which the stream reaches it
        self.done = False
        self.syncs = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True

    def elapsed_time(self, end) -> float:
        if not (self.done and end.done):  # what CUDA does: cudaErrorNotReady
            raise RuntimeError("event not ready")
        return (end.t - self.t) * 1e3


class ScriptedEvents:
    """Each record() takes the next device timestamp of the script; tracks which events are live."""

    def __init__(self, times: list[float]) -> None:
        self.times = list(times)
        self.recorded: list[ScriptedEvent] = []
        self.live: set[int] = set()

    def record(self) -> ScriptedEvent:
        e = ScriptedEvent(self.times.pop(0))
        self.recorded.append(e)
        self.live.add(id(e))
        return e

    def release(self, e: ScriptedEvent) -> None:
        assert id(e) in self.live, "released twice"
        self.live.remove(id(e))

    def complete_all(self) -> None:
        for e in self.recorded:
            e.done = True


def _steps(tl: DeviceTimeline, decode_flags) -> None:
    for d in decode_flags:
        tl.begin()
        tl.end(d)


def test_busy_and_gaps_follow_the_event_timestamps():
    ev = ScriptedEvents([0.0, 1.0, 1.25, 2.0, 2.0, 3.5])
    tl = DeviceTimeline(ev)
    _steps(tl, [False, True, True])
    ev.complete_all()
    assert tl.drain() == [
        StepTiming(busy_s=1.0, gap_s=None, decode=False),
        StepTiming(busy_s=0.75, gap_s=0.25, decode=True),
        StepTiming(busy_s=1.5, gap_s=0.0, decode=True),
    ]
    assert tl.drain() == []  # each step is returned once
    assert len(ev.live) == 1  # only the last end event is kept: the next step's gap starts there


def test_times_are_read_only_after_the_end_event_completed():
    ev = ScriptedEvents([0.0, 1.0, 1.5, 2.0])
    tl = DeviceTimeline(ev)
    _steps(tl, [True, True])
    assert tl.drain() == [] and tl.num_pending == 2  # nothing completed yet: nothing read, nothing waited
    s1, e1, s2, e2 = ev.recorded
    s1.done = e1.done = True
    assert tl.drain() == [StepTiming(1.0, None, True)]  # step 2's end is still outstanding
    s2.done = e2.done = True
    assert tl.drain() == [StepTiming(0.5, 0.5, True)]
    assert all(e.syncs == 0 for e in ev.recorded)


def test_drain_wait_blocks_on_the_pending_events_only():
    ev = ScriptedEvents([0.0, 1.0, 3.0, 4.0])
    tl = DeviceTimeline(ev)
    _steps(tl, [True, False])
    for e in ev.recorded[:2]:
        e.done = True
    ev.recorded[2].done = True  # the stream reached step 2's start, not its end
    assert tl.drain(wait=True) == [StepTiming(1.0, None, True), StepTiming(1.0, 2.0, False)]
    assert [e.syncs for e in ev.recorded] == [0, 0, 0, 1]


def test_break_chain_leaves_the_next_gap_unmeasured_and_frees_the_last_end():
    ev = ScriptedEvents([0.0, 1.0, 5.0, 6.0, 6.5, 7.0])
    tl = DeviceTimeline(ev)
    _steps(tl, [True])
    tl.break_chain()  # e.g. the engine ran out of requests: the idle time 1.0 -> 5.0 is no loop overhead
    _steps(tl, [True, True])
    ev.complete_all()
    assert [t.gap_s for t in tl.drain()] == [None, None, 0.5]
    assert len(ev.live) == 1
    tl.break_chain()
    assert ev.live == set()  # every event recorded went back to the source


def test_a_step_that_never_ended_is_dropped_and_breaks_the_chain():
    ev = ScriptedEvents([0.0, 1.0, 2.0, 10.0, 11.0])
    tl = DeviceTimeline(ev)
    _steps(tl, [True])
    tl.begin()  # the step raised before end(): its start event at 2.0 is abandoned
    _steps(tl, [True])
    ev.complete_all()
    assert tl.drain() == [StepTiming(1.0, None, True), StepTiming(1.0, None, True)]
    assert len(ev.live) == 1


def test_end_is_a_no_op_without_an_open_step():
    ev = ScriptedEvents([0.0, 2.0])
    tl = DeviceTimeline(ev)
    tl.end(True)  # nothing open: records nothing
    tl.begin()
    tl.end(True)
    tl.end(False)  # the worker may call end on every path out of a step
    ev.complete_all()
    assert tl.drain() == [StepTiming(2.0, None, True)]


def test_summary_percentiles_match_numpy_and_keep_decode_steps_only():
    rng = np.random.default_rng(0)
    gaps, busy = rng.exponential(1e-4, 101), rng.uniform(1e-3, 2e-3, 101)
    timings = [StepTiming(float(b), float(g), True) for g, b in zip(gaps, busy)]
    # a prefill step (huge gap) and a first-of-chain step (no gap) must not count
    timings += [StepTiming(0.5, 9.0, False), StepTiming(0.1, None, True)]
    s = summarize_timings(timings)
    assert s["timed_steps"] == 101
    assert s["idle_gap_us_median"] == pytest.approx(np.median(gaps) * 1e6, rel=1e-12)
    assert s["idle_gap_us_p90"] == pytest.approx(np.percentile(gaps, 90) * 1e6, rel=1e-12)
    assert s["idle_gap_us_mean"] == pytest.approx(statistics.fmean(gaps) * 1e6, rel=1e-12)
    assert s["idle_gap_us_max"] == pytest.approx(gaps.max() * 1e6, rel=1e-12)
    assert s["device_busy_us_median"] == pytest.approx(np.median(busy) * 1e6, rel=1e-12)
    assert s["device_idle_fraction"] == pytest.approx(gaps.sum() / (gaps.sum() + busy.sum()), rel=1e-12)
    assert summarize_timings(timings, decode_only=False)["timed_steps"] == 102
    empty = summarize_timings([StepTiming(0.1, None, True)])
    assert empty["timed_steps"] == 0 and all(v is None for k, v in empty.items() if k != "timed_steps")
    with pytest.raises(ValueError, match="every gap must be finite"):
        summarize_timings([StepTiming(0.1, math.nan, True)])


def test_nothing_is_timed_on_the_cpu(micro_checkpoint):
    assert device_timeline("cpu") is None
    with LLM(model=str(micro_checkpoint), device="cpu", block_size=16, max_model_len=64) as llm:
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=3), use_tqdm=False)
        llm.engine.flush_device_timing()
        st = llm.engine.stats
        assert llm.engine.worker.timeline is None
        assert (st.device_steps, st.device_gaps, st.device_busy_s, st.device_idle_gap_s) == (0, 0, 0.0, 0.0)
        assert len(st.device_timings) == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_times_every_step_in_order(micro_checkpoint, monkeypatch, async_scheduling):
    """The engine's wiring with a real event source (host clock: exact for the synchronous CPU): one
    timing per step, prefill then decode steps, no gap before a run's first step, gaps + spans within
    the run's wall time."""
    monkeypatch.delenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", raising=False)
    kw = dict(device="cpu", async_scheduling=async_scheduling, block_size=16, max_model_len=64)
    with LLM(model=str(micro_checkpoint), **kw) as llm:
        eng = llm.engine
        assert eng.use_async == async_scheduling
        eng.worker.timeline = DeviceTimeline(HostClockEvents())
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        for _ in range(2):  # the second run must not see the idle time after the first as a gap
            eng.stats.__init__()
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
            wall = time.perf_counter() - t0
            eng.flush_device_timing()
            st = eng.stats
            timings = list(st.device_timings)
            # both prompts prefill in one step (its token is the first), then 3 decode steps
            assert [t.decode for t in timings] == [False, True, True, True]
            assert st.device_steps == st.steps == 4
            assert timings[0].gap_s is None and st.device_gaps == 3
            assert all(t.busy_s > 0 and t.gap_s >= 0 for t in timings[1:])
            assert st.device_busy_s == pytest.approx(sum(t.busy_s for t in timings))
            assert st.device_idle_gap_s == pytest.approx(sum(t.gap_s for t in timings[1:]))
            assert st.device_idle_gap_max_s == max(t.gap_s for t in timings[1:])
            assert st.device_busy_s + st.device_idle_gap_s <= wall


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gaps_are_finite_and_the_async_loop_does_not_widen_them(micro_checkpoint, monkeypatch):
    monkeypatch.delenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", raising=False)
    prompts = [[0, 40 + i, 77, 91, 12, 300, 5 + i] for i in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    medians, tokens = {}, {}
    for loop in (False, True):
        kw = dict(device="cuda", async_scheduling=loop, block_size=16, max_model_len=256)
        with LLM(model=str(micro_checkpoint), **kw) as llm:
            eng = llm.engine
            assert eng.use_async == loop and eng.worker.timeline is not None
            llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)  # warm-up
            eng.flush_device_timing()
            eng.stats.__init__()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            eng.flush_device_timing()
            tokens[loop] = [o.outputs[0].token_ids for o in outs]
            st = eng.stats
            timings = list(st.device_timings)
            assert st.device_steps == st.steps == len(timings)
            assert timings[0].gap_s is None
            decode = [t for t in timings if t.decode and t.gap_s is not None]
            assert len(decode) >= 20
            assert all(math.isfinite(t.gap_s) and t.gap_s >= 0 for t in decode)
            assert all(math.isfinite(t.busy_s) and t.busy_s > 0 for t in timings)
            medians[loop] = summarize_timings(timings)["idle_gap_us_median"]
    assert tokens[True] == tokens[False]
    assert medians[True] <= 1.5 * medians[False], medians
