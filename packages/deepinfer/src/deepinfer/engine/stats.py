"""What the engine counts: host time per phase, tokens, prefill FLOPs, and the device's own timeline.

`EngineStats` is plain counters (summed over the steps since it was made); `collect_device_timing`
adds the steps whose CUDA end events have completed, and `log_stats` prints a line every
DEEPINFER_LOGGING_INTERVAL_STEP steps.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from .. import envs
from . import scheduling
from .device_timing import DeviceTimeline, StepTiming

logger = logging.getLogger("deepinfer")

DEVICE_TIMINGS_KEPT = (
    65536  # per-step device timings an engine keeps (a long-running server's memory stays bounded)
)


@dataclass
class EngineStats:
    steps: int = 0
    schedule_s: float = 0.0  # main-thread time in Scheduler.schedule()
    hidden_schedule_s: float = 0.0  # of which ran while the worker was busy with the previous step
    prepare_s: float = 0.0  # reconcile + runner batch + sampler rows + grammar masks
    hidden_prepare_s: float = 0.0  # of which ran while the worker was busy
    forward_s: float = 0.0
    sample_s: float = 0.0
    process_s: float = 0.0  # update_from_output + detokenization + stop handling
    hidden_process_s: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    draft_s: float = 0.0  # drafter time (speculative decoding)
    # Estimated FP8-equivalent FLOPs of all prefill chunks run (V4.1 models; YoCo-skipped rows excluded).
    prefill_flops: float = 0.0
    # Device timing from CUDA events (device_timing.py): each step's span on the device and the idle
    # gap before it (previous step's end -> its start; not measured for the first step after the
    # engine was idle). Read lazily, so the newest steps arrive a step late (`flush_device_timing()`
    # waits for all). On the CPU nothing is recorded: these stay 0 / empty.
    device_steps: int = 0  # steps timed
    device_busy_s: float = 0.0  # sum of their spans
    device_busy_max_s: float = 0.0
    device_gaps: int = 0  # steps with a measured gap before them
    device_idle_gap_s: float = 0.0  # sum of those gaps
    device_idle_gap_max_s: float = 0.0
    # the last DEVICE_TIMINGS_KEPT steps, oldest first, for percentiles (summarize_timings)
    device_timings: deque[StepTiming] = field(default_factory=lambda: deque(maxlen=DEVICE_TIMINGS_KEPT))

    def add_device_timing(self, t: StepTiming) -> None:
        self.device_steps += 1
        self.device_busy_s += t.busy_s
        self.device_busy_max_s = max(self.device_busy_max_s, t.busy_s)
        if t.gap_s is not None:
            self.device_gaps += 1
            self.device_idle_gap_s += t.gap_s
            self.device_idle_gap_max_s = max(self.device_idle_gap_max_s, t.gap_s)
        self.device_timings.append(t)


def collect_device_timing(stats: EngineStats, timeline: DeviceTimeline | None, wait: bool = False) -> None:
    """Add the steps whose end events have completed (all launched so far with `wait`); no-op untimed."""
    if timeline is not None:
        for t in timeline.drain(wait=wait):
            stats.add_device_timing(t)


def log_stats(stats: EngineStats, scheduler) -> None:
    """One info line every DEEPINFER_LOGGING_INTERVAL_STEP steps (0: never)."""
    interval = envs.DEEPINFER_LOGGING_INTERVAL_STEP
    if interval <= 0 or stats.steps == 0 or stats.steps % interval:
        return
    s = scheduling.stats(scheduler)
    logger.info(
        "step %d: running %d waiting %d, KV usage %.1f%%, prefix-cache hit rate %.1f%%, preemptions %d, "
        "generated %d tokens, prefill %.3g FLOP (est.)",
        stats.steps,
        s["num_running"],
        s["num_waiting"],
        100 * s["kv_usage"],
        100 * s["prefix_cache_hit_rate"],
        s["num_preemptions"],
        stats.generated_tokens,
        stats.prefill_flops,
    )
