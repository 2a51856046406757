"""From the step records of data-parallel ranks (`DataParallelEngine.step_traces()`) to the harness's
intervals: each figure of a multi-rank row comes from the ranks that ran.

A step of the world lasts as long as its slowest rank's step (an expert-parallel group waits for its
last rank at every all-to-all), produces the tokens of all ranks, and is flagged (dropped from every
average) if an EPLB flush or rebalance was charged to it on any rank. The ranks of an EP group vote
once per step, so their k-th steps are the same step: the records are matched by index, and the
forwards counted by the ranks of a group must agree at every matched step (else the traces are not
aligned and nothing is reported).
"""

from __future__ import annotations

import os
import socket
from collections import Counter

from .intervals import Interval


def ranks_that_ran(traces: list[dict]) -> dict:
    """Who produced the traces: the data-parallel size a row may report is the number of distinct
    processes that sent step records, none of them this one. Raises RuntimeError otherwise."""
    if not traces:
        raise RuntimeError("no rank reported step records: nothing was measured on data-parallel ranks")
    ids = [t.get("identity") or {} for t in traces]
    missing = [i for i, (t, who) in enumerate(zip(traces, ids)) if not t.get("steps") or "pid" not in who]
    if missing:
        raise RuntimeError(f"data-parallel ranks {missing} sent no step records")
    procs = {(who.get("host"), who["pid"]) for who in ids}
    if len(procs) != len(traces):
        raise RuntimeError(f"{len(traces)} rank traces came from {len(procs)} processes: {sorted(procs)}")
    if (socket.gethostname(), os.getpid()) in procs:
        raise RuntimeError("a rank trace came from the benchmark's own process: it is not a rank")
    return {
        "dp": len(traces),
        "rank_pids": [who["pid"] for who in ids],
        "rank_hosts": sorted({str(who.get("host")) for who in ids}),
        "eplb_ranks": sum(bool(who.get("eplb")) for who in ids),
    }


def _check_aligned(traces: list[dict], index: int) -> None:
    groups: dict[tuple, list[int]] = {}
    for t in traces:
        who = t["identity"]
        if len(who.get("ep_ranks", ())) > 1:
            groups.setdefault(tuple(who["ep_ranks"]), []).append(t["steps"][index]["forwards"])
    for members, forwards in groups.items():
        if len(set(forwards)) > 1:
            raise RuntimeError(
                f"step {index}: EP group {list(members)} reports forwards {forwards}; the rank traces are "
                "not aligned"
            )


def world_step(traces: list[dict], index: int) -> Interval:
    """The world's `index`-th step: the slowest rank's time, every rank's tokens and sequences,
    flagged if any rank was charged an EPLB event."""
    _check_aligned(traces, index)
    steps = [t["steps"][index] for t in traces]
    return Interval(
        seconds=max(s["seconds"] for s in steps),
        tokens=sum(s["emitted_tokens"] for s in steps),
        steps=1,
        flagged=any(s["events"] for s in steps),
        batch=sum(s["running"] for s in steps),
    )


def window_events(traces: list[dict], indices: range) -> Counter:
    """Per event kind, how many of the given world steps were charged one on some rank."""
    out: Counter = Counter()
    for i in indices:
        out.update({kind for t in traces for kind in t["steps"][i]["events"]})
    return out


def decode_window(traces: list[dict], per_rank_batch: int, warmup: int, measure: int) -> range:
    """Indices of the measured decode steps: after the first step at which every rank runs exactly
    `per_rank_batch` sequences, all past their prefill, none waiting or finishing, skip `warmup`
    steps and take `measure`, all of them in that state."""
    n = min(len(t["steps"]) for t in traces)

    def steady(i: int) -> bool:
        return all(
            s["running"] == per_rank_batch and s["waiting"] == 0 and s["decoding"] and s["finished"] == 0
            for s in (t["steps"][i] for t in traces)
        )

    first = next((i for i in range(n) if steady(i)), None)
    if first is None:
        raise RuntimeError(f"no step ran {per_rank_batch} decoding sequences on every rank")
    window = range(first + warmup, first + warmup + measure)
    short = [i for i in window if i >= n or not steady(i)]
    if short:
        raise RuntimeError(
            f"decode window: step {short[0]} of {n} is not a full decode step on every rank (raise max_tokens)"
        )
    return window


def prefill_interval(traces: list[dict], chunk: int) -> tuple[Interval, set[str]]:
    """One prefill repetition: every rank prefilled one `chunk`-token prompt (max_tokens 1). Per rank,
    its time from its first step with work to the step that finished the request; the world's
    interval is the slowest rank's, with every rank's chunk, flagged if any rank was charged an
    event (the kinds charged are returned with it)."""
    seconds, kinds = [], set()
    for t in traces:
        steps = t["steps"]
        active = [
            i
            for i, s in enumerate(steps)
            if s["running"] or s["waiting"] or s["finished"] or s["emitted_tokens"]
        ]
        done = [i for i in active if steps[i]["finished"]]
        if len(done) != 1:
            raise RuntimeError(
                f"rank {t['identity'].get('rank')}: {len(done)} prefill requests finished, want 1"
            )
        span = steps[active[0] : done[0] + 1]
        seconds.append(sum(s["seconds"] for s in span))
        kinds.update(kind for s in span for kind in s["events"])
    return Interval(max(seconds), chunk * len(traces), 1, bool(kinds)), kinds
