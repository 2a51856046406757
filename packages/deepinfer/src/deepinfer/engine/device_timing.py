"""Device busy time per engine step and the device's idle gap between steps, from CUDA events.

Why: the asynchronous loop exists so that the device never waits for the host between steps. Host
timers cannot show that (they measure the host); two events per step on the stream the forward runs
on can: for each step the worker records

* `start` on the stream just before it launches the forward (the runner builds its inputs after it),
* `end` just after sampling has been enqueued (before the sampled ids are copied to the host),

and then  busy(N) = end(N) - start(N)   and   gap(N) = start(N) - end(N - 1).

Both events of consecutive steps sit on one stream, so they complete in order and gap >= 0. When
the host recorded start(N) before the device reached end(N - 1) (the asynchronous loop queued N
behind N - 1), start(N) completes right after end(N - 1) and the gap is ~0; when the host was still
committing N - 1 and scheduling N (the synchronous loop), the gap is that host time. busy(N) is the
step's span on the device, host stalls inside the step included (a launch-bound model spends it
waiting for launches), not kernel time. Work queued between end(N - 1) and start(N) (a per-row
log-softmax for logprobs) falls into the gap.

Nothing here synchronises: a step's times are read once its end event has completed (`query()`),
normally when the next step's events are recorded, or at the end with `drain(wait=True)`.
On the CPU there is no asynchronous device to leave idle: the engine records nothing and its device
stats stay zero / empty (`device_timeline` returns None). `HostClockEvents` is an event source with
the same interface for a synchronous device (host clock at record time); tests use it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


class TimingEvent(Protocol):
    def query(self) -> bool: ...  # completed on the device?

    def synchronize(self) -> None: ...  # wait until completed

    def elapsed_time(self, end_event) -> float: ...  # milliseconds from self to end_event


class EventSource(Protocol):
    def record(self) -> TimingEvent: ...  # an event recorded now on the stream the step's work goes to

    def release(self, event: TimingEvent) -> None: ...  # no longer referenced: may be reused


@dataclass(frozen=True)
class StepTiming:
    busy_s: float  # device span of the step: end event - start event
    gap_s: float | None  # idle gap before it: its start - the previous step's end (None: first of a chain)
    decode: bool  # every sequence of the step computed only tokens that produce logits (no prefill chunk)


class CudaEvents:
    """Timing events on the CUDA stream current at record time (the one the forward is launched on).
    Events are pooled: creating one costs tens of microseconds on the step's critical path."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._free: list[torch.cuda.Event] = []

    def record(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def release(self, event: torch.cuda.Event) -> None:
        self._free.append(event)


class _HostEvent:
    __slots__ = ("t",)

    def __init__(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: _HostEvent) -> float:
        return (end_event.t - self.t) * 1e3


class HostClockEvents:
    """Events stamped with the host clock when recorded: exact for a device that runs synchronously
    with the host (the CPU), where the step's work is done when the call that launched it returns."""

    def record(self) -> _HostEvent:
        return _HostEvent(time.perf_counter())

    def release(self, event: _HostEvent) -> None:
        pass


@dataclass
class _Pending:
    start: TimingEvent
    end: TimingEvent
    prev_end: TimingEvent | None
    decode: bool


class DeviceTimeline:
    """Per-step start / end events, resolved lazily into `StepTiming`s in step order.

    `begin()` / `end()` are called by the thread that launches the steps (the worker), `drain()` /
    `break_chain()` by the engine's thread: a lock guards the shared state (nothing here blocks on the
    device except `drain(wait=True)`)."""

    def __init__(self, events: EventSource) -> None:
        self.events = events
        self._lock = threading.Lock()
        self._open: TimingEvent | None = None  # start event of the step being launched
        self._last_end: TimingEvent | None = None  # end of the previous step; None: next gap not measured
        self._pending: deque[_Pending] = deque()
        # An end event is referenced by its own step and by the next step (as its prev_end) or the
        # chain (`_last_end`); it goes back to the source when both are done with it.
        self._refs: dict[int, int] = {}

    def begin(self) -> None:
        """Record the step's start event (before the forward is launched)."""
        with self._lock:
            if self._open is not None:
                # The previous step raised between begin and end: its span is unknown, and so is the
                # gap after it. Drop it and start a new chain.
                self._unref(self._open)
                self._drop_chain()
            self._open = self._ref(self.events.record(), 1)

    def end(self, decode: bool) -> None:
        """Record the step's end event (after sampling is enqueued). A no-op when no step is open,
        so the worker may call it on every path out of a step."""
        with self._lock:
            if self._open is None:
                return
            end = self._ref(self.events.record(), 2)  # its step + the chain
            self._pending.append(_Pending(self._open, end, self._last_end, decode))
            self._last_end, self._open = end, None  # the chain's reference moves on to the new end

    def break_chain(self) -> None:
        """The device is idle for reasons outside the loop (no requests): the next step's gap is not
        a loop overhead and is not measured."""
        with self._lock:
            self._drop_chain()

    def drain(self, wait: bool = False) -> list[StepTiming]:
        """The steps whose events have completed, oldest first (each returned once). wait: block
        until every ended step's events have completed (end of a run; never on the step path)."""
        out: list[StepTiming] = []
        with self._lock:
            while self._pending:
                p = self._pending[0]
                # One stream: the end event completing implies the start and the previous end did.
                if not p.end.query():
                    if not wait:
                        break
                    p.end.synchronize()
                busy = p.start.elapsed_time(p.end) / 1e3
                gap = p.prev_end.elapsed_time(p.start) / 1e3 if p.prev_end is not None else None
                self._pending.popleft()
                self._unref(p.start)
                if p.prev_end is not None:
                    self._unref(p.prev_end)
                self._unref(p.end)
                out.append(StepTiming(busy, gap, p.decode))
        return out

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # reference counts (under the lock)
    def _ref(self, event: TimingEvent, n: int) -> TimingEvent:
        self._refs[id(event)] = n
        return event

    def _unref(self, event: TimingEvent) -> None:
        k = id(event)
        self._refs[k] -= 1
        if self._refs[k] == 0:
            del self._refs[k]
            self.events.release(event)

    def _drop_chain(self) -> None:
        if self._last_end is not None:
            self._unref(self._last_end)
            self._last_end = None


def device_timeline(device: torch.device | str) -> DeviceTimeline | None:
    """The timeline the engine's worker records into: CUDA events on a CUDA device, None elsewhere
    (the CPU runs synchronously with the host: there is no device idle time to measure)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return DeviceTimeline(CudaEvents(device))


def summarize_timings(timings: Iterable[StepTiming], decode_only: bool = True) -> dict:
    """Median / p90 / mean / max of the idle gap and the median busy time, in microseconds (keys say
    so), over the steps with a measured gap (decode steps only unless decode_only=False), and the
    idle fraction gap / (gap + busy) of those steps. Values are None when no step was timed."""
    steps = [t for t in timings if t.gap_s is not None and (t.decode or not decode_only)]
    gaps = [t.gap_s * 1e6 for t in steps]
    busy = [t.busy_s * 1e6 for t in steps]
    for name, values in (("gap", gaps), ("busy", busy)):
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"step timings: every {name} must be finite")
    total = sum(gaps) + sum(busy)
    return {
        "timed_steps": len(steps),
        "idle_gap_us_median": _percentile(gaps, 50),
        "idle_gap_us_p90": _percentile(gaps, 90),
        "idle_gap_us_mean": sum(gaps) / len(gaps) if gaps else None,
        "idle_gap_us_max": max(gaps) if gaps else None,
        "device_busy_us_median": _percentile(busy, 50),
        "device_idle_fraction": sum(gaps) / total if steps and total > 0 else None,
    }


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


__all__ = [
    "CudaEvents",
    "DeviceTimeline",
    "EventSource",
    "HostClockEvents",
    "StepTiming",
    "TimingEvent",
    "device_timeline",
    "summarize_timings",
]
