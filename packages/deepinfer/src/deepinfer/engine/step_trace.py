"""A data-parallel rank's record of its own engine steps, for benchmarks that must report what the
ranks measured (`deepinfer bench` with `data_parallel_size > 1`).

While the front has tracing on (`DataParallelEngine.start_step_trace`), each rank times every
`engine.step()` on its own clock and notes, per step, what the harness needs to pick a measurement
window (running / waiting sequences, whether all running ones were past their prefill, tokens emitted,
requests finished) and which EPLB events of its own process (load-statistic flushes, rebalances,
heard through `EplbState.add_listener`) fell in the step. The records go to the front with the rank's
statistics; times never cross processes, only durations and flags do, so ranks on other hosts work
the same.

An event is charged to every step whose span, from the previous step's end to its own end, meets the
event's span (so an event between two steps is charged to the next). Under the asynchronous loop the
EPLB step runs on the model thread behind the forward; a step there waits for the forward launched a
step earlier, so the step after the one an event met is charged too.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepRecord:
    seconds: float  # wall time of engine.step() on this rank
    emitted_tokens: int  # tokens committed in the step (accepted drafts included)
    running: int  # sequences running after the step
    waiting: int  # sequences waiting after the step
    decoding: bool  # every request held when the step began had emitted its first token
    finished: int  # requests that finished in the step
    forwards: int  # forwards this rank had submitted after the step (equal across an EP group)
    events: tuple[str, ...] = ()  # EPLB events charged to the step (kinds, one per event)
    # time.perf_counter() when the step ended: the host's monotonic clock, which every process of one
    # host shares, so a front can place the ranks' steps against its own times
    end: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


class StepTrace:
    """Step records of one rank. `on_event` is an EPLB listener (it may be called from the model
    thread); `record` is called by the rank's loop after each step while `enabled`; `take` hands out
    the records so far and forgets them; `restart` turns recording on afresh."""

    def __init__(self, async_loop: bool) -> None:
        self.async_loop = async_loop
        self.pid = os.getpid()
        self.enabled = False
        self._events: deque[tuple[str, float, float]] = deque()  # appended by any thread
        self._records: list[StepRecord] = []
        self._last_end: float | None = None
        self._carry: list[str] = []  # async loop: events charged to the next step as well
        self.event_counts: Counter[str] = Counter()  # events heard while enabled

    def restart(self, enabled: bool = True) -> None:
        self._events.clear()
        self._records, self._carry, self._last_end = [], [], None
        self.event_counts = Counter()
        self.enabled = enabled

    def on_event(self, kind: str, start: float, end: float) -> None:
        if self.enabled:
            self.event_counts[kind] += 1
            self._events.append((kind, start, end))

    def record(self, start: float, end: float, **fields) -> StepRecord:
        since = start if self._last_end is None else self._last_end
        charged, keep = list(self._carry), []
        self._carry = []
        for _ in range(len(self._events)):  # (only what is queued now: the model thread may append)
            kind, a, b = self._events.popleft()
            if a <= end and b >= since:
                charged.append(kind)
                if self.async_loop and b <= end:
                    self._carry.append(kind)
            if b > end:  # still going on: the next step meets it too
                keep.append((kind, a, b))
        self._events.extendleft(reversed(keep))
        self._last_end = end
        rec = StepRecord(seconds=end - start, events=tuple(charged), end=end, **fields)
        self._records.append(rec)
        return rec

    def take(self) -> list[dict]:
        out = [r.as_dict() for r in self._records]
        self._records = []
        return out
