"""Timed intervals and the flag hook that drops the ones a MoE load-balancing event disturbed.

The reference drops (never smooths over) intervals during which the MoE load-balance statistic was
flushed (an all-gather over the EP group every N steps) or EPLB rebalanced: those steps carry a
collective or a weight shuffle that ordinary steps do not. `FlagCounter` counts such events; the
harness reads it before and after each interval and flags the interval if it moved. Anything can
report an event with `mark(kind)`; `watch(obj)` wires it to `deepinfer_parallel`'s EPLB objects of this
process. The EPLB of data-parallel ranks runs in their own processes: their steps and events come back
as step traces (`rank_steps.py`), flagged there.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    seconds: float
    tokens: int  # tokens the interval produced under the phase's counting (non-cached prompt / emitted)
    steps: int = 1
    flagged: bool = False
    batch: int = 0  # sequences running (decode)


class FlagCounter:
    """Monotone count of timing-disturbing events (load-balance stat flushes, EPLB rebalances)."""

    def __init__(self) -> None:
        self.count = 0
        self.kinds: Counter[str] = Counter()

    def mark(self, kind: str = "event") -> None:
        self.count += 1
        self.kinds[kind] += 1

    def watch(self, obj) -> bool:
        """Count `obj`'s flushes / rebalances: an `EplbState` (both) or a `MoeLoadStats` (flushes),
        through their listeners (watching an object twice counts its events once).
        Returns False when `obj` is neither.
        """
        from deepinfer_parallel import EplbState, MoeLoadStats

        if isinstance(obj, EplbState | MoeLoadStats):
            obj.add_listener(self.heard)
            return True
        return False

    def heard(self, kind: str, start: float = 0.0, end: float = 0.0) -> None:
        """An EPLB listener (`kind`, and the event's span, unused here: the interval it fell in is
        the one being timed)."""
        self.mark(kind)

    def watch_all(self, root, max_depth: int = 4) -> int:
        """Find EPLB objects reachable from `root` (an engine, a runner, a model) and watch them."""
        seen: set[int] = set()
        found = 0

        def walk(o, depth: int) -> None:
            nonlocal found
            if id(o) in seen or depth > max_depth or o is None or isinstance(o, str | bytes | int | float):
                return
            seen.add(id(o))
            if self.watch(o):
                found += 1
                return
            if isinstance(o, list | tuple):
                children = o
            elif isinstance(o, dict):
                children = o.values()
            elif type(o).__module__.startswith(("deepinfer", "__main__")) and hasattr(o, "__dict__"):
                children = vars(o).values()
            else:
                return
            for c in children:
                walk(c, depth + 1)

        walk(root, 0)
        return found


def timed(fn, flags: FlagCounter | None, tokens_fn, batch: int = 0) -> tuple[Interval, object]:
    """Run `fn()` as one interval; `tokens_fn(result)` counts its tokens; flagged if an event fired."""
    before = flags.count if flags else 0
    t0 = time.perf_counter()
    result = fn()
    dt = time.perf_counter() - t0
    flagged = bool(flags) and flags.count != before
    return Interval(dt, tokens_fn(result), 1, flagged, batch), result


@dataclass(frozen=True)
class WindowStats:
    intervals: int  # kept (unflagged)
    dropped: int  # flagged, excluded from every average
    seconds: float
    tokens: int
    steps: int

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def summarize(intervals: list[Interval]) -> WindowStats:
    """Averages over the unflagged intervals only; a flagged interval contributes nothing (no smoothing)."""
    kept = [iv for iv in intervals if not iv.flagged]
    if not kept:
        raise ValueError(f"all {len(intervals)} intervals of the window were flagged; lengthen the window")
    return WindowStats(
        intervals=len(kept),
        dropped=len(intervals) - len(kept),
        seconds=sum(iv.seconds for iv in kept),
        tokens=sum(iv.tokens for iv in kept),
        steps=sum(iv.steps for iv in kept),
    )
