"""The decode step-time curve (tokens in a step -> forward milliseconds) and the online estimators.

The reference (spec §2.6) measures one forward time per CUDA-graph bucket and charges a step the
baseline of the smallest bucket that holds it ("bucket" mode). Without CUDA graphs every token count
runs as it is, so "linear" mode interpolates between measured points instead (our addition; below
the first point the first time is used). Beyond the last point a step is not allowed, unless the curve
`extrapolates`: then it continues the line through its last two points (never below the last time), so
that a curve measured on small steps still prices the large batches of a busy engine.
"""

from __future__ import annotations

import bisect
import json
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

CURVE_MODES = ("bucket", "linear")


class StepTimeCurve:
    def __init__(
        self,
        sizes: Sequence[int],
        forward_ms: Sequence[float],
        mode: str = "bucket",
        extrapolate: bool = False,
    ) -> None:
        if mode not in CURVE_MODES:
            raise ValueError(f"mode must be one of {CURVE_MODES}, got {mode!r}")
        if len(sizes) != len(forward_ms):
            raise ValueError(
                f"sizes and forward_ms must have the same length, got {len(sizes)} and {len(forward_ms)}"
            )
        if not sizes:
            raise ValueError("sizes must not be empty (an empty curve means varlen is off)")
        if any(isinstance(s, bool) or int(s) != s or s < 1 for s in sizes):
            raise ValueError(f"sizes must be integers >= 1, got {list(sizes)}")
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"sizes must be strictly increasing, got {list(sizes)}")
        if any(not (ms > 0 and ms < float("inf")) for ms in forward_ms):
            raise ValueError(f"forward_ms must be finite and > 0, got {list(forward_ms)}")
        self.sizes = [int(s) for s in sizes]
        self.forward_ms = [float(ms) for ms in forward_ms]
        self.mode = mode
        self.extrapolate = bool(extrapolate)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def charged(self, num_tokens: int) -> tuple[int, float] | None:
        """(size charged for the slope term, baseline ms) for a step of num_tokens; None if too large
        (beyond the last point of a curve that does not extrapolate)."""
        if num_tokens > self.sizes[-1]:
            if not self.extrapolate:
                return None
            last, ms = self.sizes[-1], self.forward_ms[-1]
            per_token = 0.0
            if len(self.sizes) > 1:
                per_token = max(0.0, (ms - self.forward_ms[-2]) / (last - self.sizes[-2]))
            return num_tokens, ms + per_token * (num_tokens - last)
        idx = bisect.bisect_left(self.sizes, num_tokens)
        if self.mode == "bucket" or self.sizes[idx] == num_tokens or idx == 0:
            size = self.sizes[idx] if self.mode == "bucket" else num_tokens
            return size, self.forward_ms[idx]
        s0, s1 = self.sizes[idx - 1], self.sizes[idx]
        m0, m1 = self.forward_ms[idx - 1], self.forward_ms[idx]
        return num_tokens, m0 + (m1 - m0) * (num_tokens - s0) / (s1 - s0)

    def charged_array(self, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`charged` of many step sizes at once (a plan prices every total): (sizes charged, baseline ms)
        as float64 arrays, NaN where the curve does not reach; each value the scalar's, bit for bit (the
        same operations in the same order)."""
        n = np.asarray(num_tokens, dtype=np.int64)
        sizes, ms = np.asarray(self.sizes, dtype=np.int64), np.asarray(self.forward_ms, dtype=np.float64)
        inside = n <= sizes[-1]
        idx = np.minimum(np.searchsorted(sizes, n, side="left"), len(sizes) - 1)
        exact = inside & ((sizes[idx] == n) | (idx == 0) | (self.mode == "bucket"))
        size = np.where(exact & (self.mode == "bucket"), sizes[idx], n).astype(np.float64)
        baseline = np.full(n.shape, np.nan)
        baseline[exact] = ms[idx[exact]]
        between = inside & ~exact
        lo = idx[between] - 1
        s0, s1, m0, m1 = sizes[lo], sizes[lo + 1], ms[lo], ms[lo + 1]
        baseline[between] = m0 + (m1 - m0) * (n[between] - s0) / (s1 - s0)
        beyond = ~inside
        if self.extrapolate and beyond.any():
            last, last_ms = self.sizes[-1], self.forward_ms[-1]
            per_token = 0.0
            if len(self.sizes) > 1:
                per_token = max(0.0, (last_ms - self.forward_ms[-2]) / (last - self.sizes[-2]))
            baseline[beyond] = last_ms + per_token * (n[beyond] - last)
        else:
            size[beyond] = np.nan
        return size, baseline

    def baseline_ms(self, num_tokens: int) -> float | None:
        charged = self.charged(num_tokens)
        return None if charged is None else charged[1]

    # -- persistence and measurement -------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "sizes": self.sizes,
            "forward_ms": self.forward_ms,
            "mode": self.mode,
            "extrapolate": self.extrapolate,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> StepTimeCurve:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"step-time curve file {str(path)!r} is unreadable: {exc}") from exc
        if not isinstance(data, dict) or "sizes" not in data or "forward_ms" not in data:
            raise ValueError(
                f"step-time curve file {str(path)!r} must hold {{'sizes': [...], 'forward_ms': [...]}}"
            )
        return cls(
            data["sizes"],
            data["forward_ms"],
            data.get("mode", "bucket"),
            bool(data.get("extrapolate", False)),
        )

    @classmethod
    def measure(
        cls,
        step: Callable[[int], object],
        sizes: Sequence[int],
        repeats: int = 5,
        warmup: int = 1,
        mode: str = "bucket",
        clock: Callable[[], float] = time.perf_counter,
        extrapolate: bool = False,
    ) -> StepTimeCurve:
        """Time `step(num_tokens)` (the engine's decode forward; it must synchronise the device)
        at each size and keep the median of `repeats` runs."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        times = []
        for size in sizes:
            for _ in range(warmup):
                step(size)
            samples = []
            for _ in range(repeats):
                start = clock()
                step(size)
                samples.append((clock() - start) * 1e3)
            times.append(max(statistics.median(samples), 1e-6))
        return cls(sizes, times, mode, extrapolate)


class ForwardRuntimeEstimator:
    """Learned extra forward cost per token on top of the curve (context-length effect, spec §2.6).

    Samples are residual = (forward_ms - baseline(size)) / size over a sliding window; per step size
    the median is taken, sizes with fewer than `min_samples` samples are ignored, and the estimate is
    the median of the per-size medians (robust against outlier steps).
    """

    def __init__(self, window: int = 5000, min_samples: int = 10) -> None:
        self.window: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self._cached: float | None = None

    def add(self, size: int, residual_ms_per_token: float) -> None:
        self.window.append((int(size), float(residual_ms_per_token)))
        self._cached = None

    def get(self) -> float:
        if self._cached is None:
            per_size: dict[int, list[float]] = {}
            for size, value in self.window:
                per_size.setdefault(size, []).append(value)
            medians = [statistics.median(v) for v in per_size.values() if len(v) >= self.min_samples]
            self._cached = statistics.median(medians) if medians else 0.0
        return self._cached


class SamplerRuntimeEstimator:
    """Sampler milliseconds per batch size: median of the last `window` timings for this number of
    sequences if at least `min_samples` exist, else the same over all sizes, else 0 (spec §2.6)."""

    def __init__(self, window: int = 9, min_samples: int = 5) -> None:
        self.window, self.min_samples = window, min_samples
        self.per_size: dict[int, deque[float]] = {}
        self.overall: deque[float] = deque(maxlen=window)

    def add(self, num_seqs: int, sampler_ms: float) -> None:
        self.per_size.setdefault(int(num_seqs), deque(maxlen=self.window)).append(float(sampler_ms))
        self.overall.append(float(sampler_ms))

    def get(self, num_seqs: int) -> float:
        own = self.per_size.get(int(num_seqs), ())
        if len(own) >= self.min_samples:
            return statistics.median(own)
        if len(self.overall) >= self.min_samples:
            return statistics.median(self.overall)
        return 0.0
