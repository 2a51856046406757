"""The two measured phases. Each runs warm-up, then a measurement window of timed intervals, then
(optionally) a profiler window: the profiler is attached only after measuring, because leaving it
costs a residual slowdown (the reference saw 7-11% at decode batch 1) that would bias the numbers.

These phases time one engine in this process: one rank, so their rows say `dp` 1. A data-parallel
engine's ranks time their own steps (`rank_phases.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.device_timing import summarize_timings
from . import accounting
from .drafts import spec_keys, spec_snapshot
from .engine_driver import Driver, profiled
from .intervals import FlagCounter, Interval, summarize, timed


@dataclass
class PrefillConfig:
    chunks: list[int]
    context: int = 0  # prompt tokens already in the prefix cache before the timed chunk
    warmup: int = 1  # untimed chunks per size
    repeats: int = 3  # timed chunks per size (each one interval)
    cp: int = 1
    profile_chunk: int | None = None
    profile_dir: Path | None = None
    profile_stacks: bool = False  # Python frames in the trace (benchmarks/gpu/trace_gaps.py names them)


@dataclass
class DecodeConfig:
    batches: list[int]
    context: int = 32  # prompt length of each request
    nextn: int = 0
    warmup_steps: int = 2
    measure_steps: int = 8
    cp: int = 1
    profile_batch: int | None = None
    profile_steps: int = 2
    profile_dir: Path | None = None
    profile_stacks: bool = False
    request_max_tokens: int | None = None  # tokens per request when the model's context caps them

    def max_tokens(self) -> int:
        if self.request_max_tokens is not None:
            return self.request_max_tokens
        # + FILL_HEADROOM: while a large batch's prompts are still prefilled (several steps once
        # batch x context exceeds the step's token budget), the requests admitted first already decode
        return self.min_max_tokens() + FILL_HEADROOM * (1 + self.nextn)

    def min_max_tokens(self) -> int:
        """Tokens a request needs for the warm-up, measured and profiled steps (plus 2 spare)."""
        steps = self.warmup_steps + self.measure_steps + self.profile_steps + 2
        return steps * (1 + self.nextn)


FILL_HEADROOM = 64  # decode steps a request may take before the last prompt of its batch is prefilled


def _check_positive(name: str, values) -> None:
    for v in values:
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be integers >= 1, got {v!r}")


def run_prefill(driver: Driver, cfg: PrefillConfig, flags: FlagCounter | None, progress=None) -> list[dict]:
    _check_positive("chunks", cfg.chunks)
    if cfg.repeats < 1 or cfg.warmup < 0 or cfg.context < 0:
        raise ValueError("prefill: need repeats >= 1, warmup >= 0, context >= 0")
    rows = []
    for chunk in cfg.chunks:
        _reset_peak_memory()
        for _ in range(cfg.warmup):
            _one_chunk(driver, chunk, cfg.context, flags, timed_run=False)
        intervals = [
            _one_chunk(driver, chunk, cfg.context, flags, timed_run=True) for _ in range(cfg.repeats)
        ]
        w = summarize(intervals)
        row = prefill_keys(chunk, cfg, w, dp=1)  # one engine, this process
        peak = _peak_memory_gib()
        if peak is not None:  # what a chunk of this size needs on the device (weights and KV pool included)
            row["peak_device_memory_gib"] = peak
        if cfg.context:
            row["prefix_cache_hit_rate_cumulative"] = float(
                driver.engine.scheduler_stats().get("prefix_cache_hit_rate", 0.0)
            )
        if cfg.profile_chunk == chunk and cfg.profile_dir is not None:
            path = cfg.profile_dir / f"prefill_chunk{chunk}.json"
            with profiled(path, cfg.profile_stacks):
                _one_chunk(driver, chunk, cfg.context, flags, timed_run=False)
            row["profile_trace"] = str(path)
        rows.append(row)
        if progress:
            progress.update(1)
    return rows


def _reset_peak_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_gib() -> float | None:
    """Peak memory torch allocated on the current CUDA device since the last reset (None: no CUDA in use)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.max_memory_allocated() / 2**30


def _one_chunk(driver: Driver, chunk: int, context: int, flags, timed_run: bool) -> Interval | None:
    """One prefill chunk of `chunk` fresh tokens after `context` tokens put in the prefix cache (untimed)."""
    prefix = driver.random_prompt(context)
    if prefix:
        driver.run_until_done({driver.add(prefix, 1)})
    prompt = prefix + driver.random_prompt(chunk)
    if not timed_run:
        driver.run_until_done({driver.add(prompt, 1)})
        return None
    interval, _ = timed(lambda: driver.run_until_done({driver.add(prompt, 1)}), flags, lambda _: chunk)
    return interval


def run_decode(driver: Driver, cfg: DecodeConfig, flags: FlagCounter | None, progress=None) -> list[dict]:
    _check_positive("batches", cfg.batches)
    if cfg.measure_steps < 1 or cfg.warmup_steps < 0 or cfg.context < 1 or cfg.nextn < 0:
        raise ValueError("decode: need measure_steps >= 1, warmup_steps >= 0, context >= 1, nextn >= 0")
    engine = driver.engine
    rows = []
    for batch in cfg.batches:
        ids = {driver.add(driver.random_prompt(cfg.context), cfg.max_tokens()) for _ in range(batch)}
        # Fill: step until every request is past its prefill, so each timed step is a pure decode step.
        for _ in range(10_000):
            if driver.waiting() == 0 and engine.stats.generated_tokens and _all_decoding(engine, ids):
                break
            _raise_errors(engine.step())
        for _ in range(cfg.warmup_steps):
            _raise_errors(engine.step())

        def one_step():
            before = engine.stats.generated_tokens
            done = engine.step()
            if done:
                _raise_errors(done)
                raise RuntimeError(
                    "a decode request finished inside the measurement window; raise max_tokens"
                )
            return engine.stats.generated_tokens - before

        spec_before, snap_before = _spec_counts(engine), spec_snapshot(engine)
        engine.flush_device_timing()  # (before the window: the steps so far are not the window's)
        timings_before, chained_before = len(engine.stats.device_timings), _chained(engine)
        intervals = []
        for _ in range(cfg.measure_steps):
            running = driver.running()
            iv, _ = timed(one_step, flags, lambda emitted: emitted, batch=running)
            intervals.append(iv)
        spec_after, snap_after = _spec_counts(engine), spec_snapshot(engine)
        chained = _chained(engine) - chained_before
        engine.flush_device_timing()
        window = list(engine.stats.device_timings)[timings_before:]
        short = [iv.batch for iv in intervals if iv.batch != batch]
        if short:
            raise RuntimeError(
                f"decode batch {batch}: steps ran with {short[0]} sequences; raise max_num_seqs / KV"
            )
        w = summarize(intervals)
        row = {
            **decode_keys(batch, cfg, w, dp=1),  # one engine, this process
            # the device's side of the window (CUDA events; None on the CPU): each step's span, the idle gap
            # before it, and how many steps the async loop launched behind the one before (device-fed ids)
            **_device_keys(window),
            "chained_launches": chained,
        }
        if spec_before is not None and spec_after is not None:
            # the engine's own verification counts over the whole window (flagged steps included)
            accepted, verified = (a - b for a, b in zip(spec_after, spec_before))
            row.update(window_drafts_verified=verified, window_drafts_accepted=accepted)
            row["window_draft_accept_rate"] = accepted / verified if verified else None
        # per draft position, mean accepted length, drafter host time (the window's; `nextn` stays cfg's)
        row.update((k, v) for k, v in spec_keys(snap_before, snap_after).items() if k != "nextn")
        if cfg.profile_batch == batch and cfg.profile_dir is not None:
            path = cfg.profile_dir / f"decode_batch{batch}.json"
            with profiled(path, cfg.profile_stacks):  # attached only now, after the window was measured
                for _ in range(cfg.profile_steps):
                    engine.step()
            row["profile_trace"] = str(path)
        driver.drain()
        rows.append(row)
        if progress:
            progress.update(1)
    return rows


def _chained(engine) -> int:
    pipeline = getattr(engine, "_pool", None)
    return getattr(pipeline, "chained_launches", 0)


def _device_keys(window) -> dict:
    summary = summarize_timings(window, decode_only=True)
    keys = ("idle_gap_us_median", "idle_gap_us_p90", "device_busy_us_median", "device_idle_fraction")
    return {k: summary[k] for k in keys}


def _spec_counts(engine) -> tuple[int, int] | None:
    """(accepted, verified) drafts so far from the engine's speculative-decoding stats, if it has them."""
    stats = engine.spec_stats() if hasattr(engine, "spec_stats") else None
    if not stats:
        return None
    return int(stats.get("accepted", 0)), int(stats.get("verified", 0))


def _raise_errors(done) -> None:
    """A benchmark request that failed (e.g. the forward raised) stops the run with its error."""
    errors = sorted({o.error for o in done if getattr(o, "error", None)})
    if errors:
        raise RuntimeError(f"benchmark request failed: {errors[0]}")


def _all_decoding(engine, ids: set[str]) -> bool:
    """Every request of the batch has emitted its first token (its prefill is over)."""
    for rid in ids:
        state = engine.requests.get(rid)
        if state is None or any(seq.num_generated == 0 for seq in state.seqs):
            return False
    return True


def prefill_keys(chunk: int, cfg: PrefillConfig, w, dp: int) -> dict:
    """A prefill row's measured keys from its window summary `w` (`intervals.summarize`) over `dp` ranks."""
    return {
        "phase": "prefill",
        "chunk_tokens": chunk,
        "context_tokens": cfg.context,
        "intervals": w.intervals,
        "dropped_flagged_intervals": w.dropped,
        "chunk_latency_ms": w.seconds / w.intervals * 1e3,
        "non_cached_tok_per_s_per_gpu": accounting.prefill_tok_per_s_per_gpu(w.tokens, w.seconds, dp, cfg.cp),
        "dp": dp,
        "cp": cfg.cp,
    }


def decode_keys(batch: int, cfg: DecodeConfig, w, dp: int) -> dict:
    """A decode row's measured keys from its window summary `w` over `dp` ranks: both accountings."""
    sps = w.steps_per_s
    return {
        "phase": "decode",
        "batch": batch,
        "context_tokens": cfg.context,
        "nextn": cfg.nextn,
        "intervals": w.intervals,
        "dropped_flagged_intervals": w.dropped,
        "steps_per_s": sps,
        "ms_per_step": w.seconds_per_step * 1e3,
        "full_acceptance_tok_per_s_per_gpu": accounting.decode_full_acceptance_per_gpu(
            sps, batch, cfg.nextn, dp, cfg.cp
        ),
        "full_acceptance_tok_per_s_per_user": accounting.decode_full_acceptance_per_user(sps, cfg.nextn),
        "measured_tok_per_s_per_gpu": accounting.decode_measured_per_gpu(w.tokens, w.seconds, dp, cfg.cp),
        "measured_tok_per_s_per_user": accounting.decode_measured_per_user(w.tokens, w.seconds, batch),
        "measured_tokens_per_request_step": w.tokens / (w.steps * batch),
        "measured_accept_rate": (w.tokens / (w.steps * batch) - 1) / cfg.nextn if cfg.nextn else None,
        "dp": dp,
        "cp": cfg.cp,
    }
