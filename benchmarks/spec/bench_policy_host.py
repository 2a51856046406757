"""Host time of the draft policy per drafted step: `DraftPolicy.plan` and `verify_counts` by batch size.

    uv run --no-sync python benchmarks/spec/bench_policy_host.py
    uv run --no-sync python benchmarks/spec/bench_policy_host.py --batches 1,64,256 --nextn 5 --steps 200

The policy runs on the engine's thread between a step's read-back and the next launch, so on a GPU its
time is device idle time. A simulated engine (no model: the policy alone is timed) decodes `--batches`
sequences with a step-time curve shaped like a small model's graphed decode step on a GPU (flat
`--step-ms` up to 256 tokens, then linear) and a draft forward of `--draft-ms`; each draft is accepted
with `--accept-rate`, so most sequences stay active members (every (sequence, position) is ranked: the
policy's most expensive case). Sampler and host times are fed at several sizes, as an engine feeds them,
so the cost model's fits are lines, not single points. After `--warmup` steps, each call of `plan` and
`verify_counts` is timed; the table gives the median microseconds per call and their sum as a share of
the planned step's predicted time (`host_share_of_step`: what the policy adds to a drafted step's idle
gap, relative to the step). One flat JSON record per batch size goes to --out (default
benchmarks/out/, untracked).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from deepinfer_spec import ConfidenceScheduler, DraftPolicy, StepTimeCurve
from rich.console import Console
from rich.table import Table


def run_batch(batch: int, args) -> dict:
    rng = random.Random(args.seed)
    curve = StepTimeCurve(
        [1, 256, 4096], [args.step_ms, args.step_ms, args.step_ms * 8], mode="linear", extrapolate=True
    )
    nextn = args.nextn
    policy = DraftPolicy(nextn, ConfidenceScheduler(nextn, curve), probe_budget=None)
    plan_us, verify_us, step_ms = [], [], []
    for step in range(args.warmup + args.steps):
        timed = step >= args.warmup
        t0 = time.perf_counter()
        plan = policy.plan([(s, nextn) for s in range(batch)], batch)
        t1 = time.perf_counter()
        ids = [s for s, d in enumerate(plan.draft) if d]
        # sizes vary as an engine's do (finished sequences, prefill steps): the fits have >= 2 sizes
        rows = batch - rng.randrange(max(1, batch // 8))
        policy.record_step_time(rows, 0.01 * rows, verified=False)
        policy.record_host_time(rows, 0.2 + 0.005 * rows, verified=False)
        if not ids:
            continue
        policy.record_draft_time(len(ids), args.draft_ms * (1 + len(ids) / 512))
        conf = [[rng.uniform(0.3, 0.95) for _ in range(nextn)] for _ in ids]
        t2 = time.perf_counter()
        counts = policy.verify_counts(ids, conf, batch)
        t3 = time.perf_counter()
        verified = batch + sum(counts)
        policy.record_step_time(verified, 0.02 * verified, verified=True)
        policy.record_host_time(verified, 0.3 + 0.008 * verified, verified=True)
        for s, k, c in zip(ids, counts, conf):
            accepted = 0
            while accepted < k and rng.random() < args.accept_rate:
                accepted += 1
            policy.record(s, c, k, accepted)
        if timed:
            plan_us.append((t1 - t0) * 1e6)
            verify_us.append((t3 - t2) * 1e6)
            step_ms.append(policy.step_ms(verified, batch))
    if not plan_us:
        raise SystemExit(f"batch {batch}: no drafted step in {args.steps} steps (raise --accept-rate)")
    plan_med, verify_med = statistics.median(plan_us), statistics.median(verify_us)
    step_med = statistics.median(step_ms)
    return {
        "batch": batch,
        "nextn": nextn,
        "accept_rate": args.accept_rate,
        "drafted_steps": len(plan_us),
        "plan_us_per_step": plan_med,
        "verify_counts_us_per_step": verify_med,
        "policy_us_per_step": plan_med + verify_med,
        "predicted_step_ms": step_med,
        "host_share_of_step": (plan_med + verify_med) / (step_med * 1e3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,64,256", help="comma-separated batch sizes")
    parser.add_argument("--nextn", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps first (the fits fill up)")
    parser.add_argument("--accept-rate", type=float, default=0.8)
    parser.add_argument("--step-ms", type=float, default=5.0, help="the curve's flat decode step")
    parser.add_argument("--draft-ms", type=float, default=1.0, help="the draft forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/out/bench_policy_host.json")
    args = parser.parse_args()
    records = [run_batch(int(b), args) for b in args.batches.split(",")]
    table = Table(title=f"draft policy host time per drafted step (nextn {args.nextn})")
    for header in (
        "batch",
        "drafted steps",
        "plan us",
        "verify_counts us",
        "policy us",
        "step ms (predicted)",
        "policy / step",
    ):
        table.add_column(header, justify="right")
    for r in records:
        table.add_row(
            str(r["batch"]),
            str(r["drafted_steps"]),
            f"{r['plan_us_per_step']:.0f}",
            f"{r['verify_counts_us_per_step']:.0f}",
            f"{r['policy_us_per_step']:.0f}",
            f"{r['predicted_step_ms']:.2f}",
            f"{r['host_share_of_step']:.3f}",
        )
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
