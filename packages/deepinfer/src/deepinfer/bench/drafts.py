"""Drafted against plain decoding in one benchmark run: what the drafts bought (acceptance per draft
position, mean accepted length) and what they cost (step time, tokens/s against the same workload
decoded with drafts off). Flat keys, units in the names, for the records of `bench throughput` and
`bench decode`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SpecSnapshot:
    """The engine's cumulative draft counts at one moment (a window is the difference of two)."""

    nextn: int
    verified: np.ndarray  # drafts verified per position (1..nextn)
    accepted: np.ndarray  # drafts accepted per position
    request_steps: int
    steps: int
    draft_s: float


def spec_snapshot(engine) -> SpecSnapshot | None:
    """None when the engine does not draft (nextn 0, or an engine without speculative state). A
    data-parallel front gives its ranks' counts summed."""
    counts = engine.spec_counts() if hasattr(engine, "spec_counts") else None
    if counts is None:
        return None
    return SpecSnapshot(
        counts["nextn"],
        np.asarray(counts["verified"], dtype=np.int64),
        np.asarray(counts["accepted"], dtype=np.int64),
        counts["request_steps"],
        counts["steps"],
        float(counts["draft_s"]),
    )


def spec_keys(before: SpecSnapshot | None, after: SpecSnapshot | None) -> dict:
    """Acceptance over the window between two snapshots: per draft position j (1-based) the drafts
    verified and the fraction accepted, the mean accepted and verified drafts per request and step,
    the tokens each request emits per step (1 + accepted) and the drafter's host time per step."""
    if before is None or after is None:
        return {"drafts_on": False, "nextn": 0}
    verified = after.verified - before.verified
    accepted = after.accepted - before.accepted
    request_steps = after.request_steps - before.request_steps
    steps = after.steps - before.steps
    out: dict = {"drafts_on": True, "nextn": after.nextn, "drafted_steps": steps}
    for j, (v, a) in enumerate(zip(verified, accepted), start=1):
        out[f"verified_drafts_pos{j}"] = int(v)
        out[f"accept_rate_pos{j}"] = float(a / v) if v else None
    out["mean_accepted_len_tokens"] = float(accepted.sum() / request_steps) if request_steps else None
    out["mean_verified_len_tokens"] = float(verified.sum() / request_steps) if request_steps else None
    out["emitted_tokens_per_request_step"] = 1.0 + out["mean_accepted_len_tokens"] if request_steps else None
    out["draft_host_ms_per_step"] = 1e3 * (after.draft_s - before.draft_s) / steps if steps else None
    return out


# (key of both records, key of the ratio drafted / plain added to the drafted record)
COMPARED = (
    ("output_tok_per_s", "output_tok_per_s_vs_plain"),
    ("ms_per_step", "ms_per_step_vs_plain"),
    ("device_busy_us_median", "device_busy_vs_plain"),
    ("idle_gap_us_median", "idle_gap_vs_plain"),
    ("measured_tok_per_s_per_user", "tok_per_s_per_user_vs_plain"),
    ("measured_tok_per_s_per_gpu", "tok_per_s_per_gpu_vs_plain"),
)


def compare_to_plain(drafted: dict, plain: dict) -> dict:
    """Keys for the drafted record: each compared value of the plain run (`plain_<key>`) and the ratio
    drafted / plain (None where either side has no value, e.g. device timings on the CPU)."""
    out = {}
    for key, ratio in COMPARED:
        if key not in drafted and key not in plain:
            continue
        mine, theirs = drafted.get(key), plain.get(key)
        out[f"plain_{key}"] = theirs
        out[ratio] = mine / theirs if mine is not None and theirs else None
    return out
