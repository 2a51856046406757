"""The two measured phases on a data-parallel engine (`DataParallelEngine`): the rank processes run
their own loops, so the front cannot time a step; each rank times its steps (`start_step_trace`) and
the intervals are built from those records (`rank_steps.py`): the slowest rank's step time, every
rank's tokens, a step flagged when any rank's EPLB flushed or rebalanced in it. The rows' `dp` is the
number of rank processes that reported, and their EPLB statistics are the ranks' own."""

from __future__ import annotations

from collections import Counter

from .drafts import spec_keys, spec_snapshot
from .engine_driver import Driver
from .intervals import summarize
from .phases import DecodeConfig, PrefillConfig, _check_positive, decode_keys, prefill_keys
from .rank_steps import decode_window, prefill_interval, ranks_that_ran, window_events, world_step


def _run(driver: Driver, ids: set[str]) -> list[dict]:
    """Trace the ranks while `ids` run to the end; the ranks' traces."""
    driver.run_until_done(ids)
    return driver.engine.step_traces()


def _eplb_keys(engine, events: Counter, ranks: dict) -> dict:
    """The running EPLB's statistics (DataParallelStats, from the ranks) and the window's events."""
    st = engine.stats
    return {
        "eplb_objects_watched": ranks["eplb_ranks"],  # ranks whose EPLB reported its events
        # intervals (world steps; prefill: chunks) charged a load-statistic flush / a rebalance
        "window_intervals_with_moe_lb_flush": events.get("moe_lb_flush", 0),
        "window_intervals_with_eplb_rebalance": events.get("eplb_rebalance", 0),
        "eplb_rebalances_total": st.eplb_rebalances,
        "eplb_moe_lb_initial": st.eplb_moe_lb_initial,
        "eplb_moe_lb": st.eplb_moe_lb,
    }


def run_prefill_ranks(driver: Driver, cfg: PrefillConfig, progress=None) -> list[dict]:
    """Each repetition sends one prompt to every rank (the front balances equal prompts one per rank)."""
    _check_positive("chunks", cfg.chunks)
    if cfg.repeats < 1 or cfg.warmup < 0 or cfg.context < 0:
        raise ValueError("prefill: need repeats >= 1, warmup >= 0, context >= 0")
    if cfg.profile_chunk is not None:
        raise ValueError("--profile-prefill-chunk: the profiler cannot reach the rank processes")
    engine = driver.engine
    dp = engine.world
    rows = []
    for chunk in cfg.chunks:
        intervals, events, ranks = [], Counter(), None
        for rep in range(cfg.warmup + cfg.repeats):
            prefixes = [driver.random_prompt(cfg.context) for _ in range(dp)]
            if cfg.context:
                driver.run_until_done({driver.add(p, 1) for p in prefixes})
            prompts = [p + driver.random_prompt(chunk) for p in prefixes]
            engine.start_step_trace()
            traces = _run(driver, {driver.add(p, 1) for p in prompts})
            if rep < cfg.warmup:
                continue
            ranks = ranks_that_ran(traces)
            iv, kinds = prefill_interval(traces, chunk)
            intervals.append(iv)
            events.update(kinds)
        engine.stop_step_trace()
        w = summarize(intervals)
        rows.append(
            {
                **prefill_keys(chunk, cfg, w, ranks["dp"]),
                "rank_pids": ranks["rank_pids"],
                "rank_hosts": ranks["rank_hosts"],
                **_eplb_keys(engine, events, ranks),
            }
        )
        if progress:
            progress.update(1)
    return rows


def decode_max_tokens(cfg: DecodeConfig, per_rank_batch: int, token_budget: int) -> int:
    """Tokens each request may emit: enough steps for the fill (prefill chunks of the whole batch),
    the warm-up and the window even when every draft is accepted, and no more (the ranks run the
    requests to their end)."""
    fill = -(-per_rank_batch * cfg.context // max(1, token_budget)) + 2
    return (fill + cfg.warmup_steps + cfg.measure_steps + 2) * (1 + cfg.nextn)


def run_decode_ranks(driver: Driver, cfg: DecodeConfig, token_budget: int, progress=None) -> list[dict]:
    """`batch` requests over the ranks (batch / dp each), run to their end while the ranks trace their
    steps; the window is chosen from the traces (`decode_window`)."""
    _check_positive("batches", cfg.batches)
    if cfg.measure_steps < 1 or cfg.warmup_steps < 0 or cfg.context < 1 or cfg.nextn < 0:
        raise ValueError("decode: need measure_steps >= 1, warmup_steps >= 0, context >= 1, nextn >= 0")
    if cfg.profile_batch is not None:
        raise ValueError("--profile-decode-batch: the profiler cannot reach the rank processes")
    engine = driver.engine
    dp = engine.world
    uneven = [b for b in cfg.batches if b % dp]
    if uneven:
        raise ValueError(f"batches {uneven}: each must be a multiple of data_parallel_size={dp}")
    rows = []
    for batch in cfg.batches:
        per_rank = batch // dp
        max_tokens = decode_max_tokens(cfg, per_rank, token_budget)
        engine.start_step_trace()
        spec_before = spec_snapshot(engine)
        traces = _run(
            driver, {driver.add(driver.random_prompt(cfg.context), max_tokens) for _ in range(batch)}
        )
        spec_after = spec_snapshot(engine)
        engine.stop_step_trace()
        ranks = ranks_that_ran(traces)
        window = decode_window(traces, per_rank, cfg.warmup_steps, cfg.measure_steps)
        intervals = [world_step(traces, i) for i in window]
        w = summarize(intervals)
        row = {
            **decode_keys(batch, cfg, w, ranks["dp"]),
            "batch_per_rank": per_rank,
            "rank_pids": ranks["rank_pids"],
            "rank_hosts": ranks["rank_hosts"],
            # each rank's own steps over the whole window (flagged ones included): how uneven they ran
            "rank_ms_per_step": [
                sum(t["steps"][i]["seconds"] for i in window) / len(window) * 1e3 for t in traces
            ],
            **_eplb_keys(engine, window_events(traces, window), ranks),
        }
        # acceptance per draft position summed over the ranks, over the whole run (the ranks count
        # drafts per run, not per traced step); `nextn` stays cfg's
        row.update((k, v) for k, v in spec_keys(spec_before, spec_after).items() if k != "nextn")
        rows.append(row)
        if progress:
            progress.update(1)
    return rows
