"""Time per engine step of the scheduler: schedule() + update_from_output(), Python boundary
included, with an instant fake model, on a synthetic offline workload (thousands of requests, mixed
prompt and output lengths, shared system-prompt prefixes, a KV pool small enough that preemption
happens). Measured at several running-batch sizes against an in-run pure-Python baseline
(py_scheduler.py) that implements the same policy and builds the same arrays.

    uv run --no-sync python benchmarks/sched/bench_scheduler.py            # 64, 256, 1024
    uv run --no-sync python benchmarks/sched/bench_scheduler.py --quick    # smaller workload

Writes benchmarks/out/bench_scheduler.json: one record per running-batch size.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import numpy as np
from deepinfer_sched import Scheduler, SchedulerConfig, build_info
from py_scheduler import PyScheduler
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_scheduler.json"


def make_workload(args, rng: np.random.Generator) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) per request: 40% start with one of 8 shared 256-token system prompts."""
    systems = [rng.integers(0, 32000, size=256).tolist() for _ in range(8)]
    work = []
    for _ in range(args.num_requests):
        n = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        prompt = rng.integers(0, 32000, size=n).tolist()
        if rng.random() < 0.4:
            prompt = systems[int(rng.integers(0, 8))] + prompt
        work.append((prompt, int(rng.integers(args.min_output, args.max_output + 1))))
    return work


def pool_blocks(work, running: int, args) -> int:
    """A KV pool that holds ~kv_fraction of `running` average-sized sequences: preemption happens."""
    bs = args.block_size
    avg = float(np.mean([-(-(len(p) + m // 2) // bs) for p, m in work]))
    return max(int(running * avg * args.kv_fraction), -(-args.max_model_len // bs))


def run(impl: str, work, running: int, num_blocks: int, args, desc: str) -> dict:
    """Runs the workload `args.repeats` times; the schedule is deterministic, so step k of every
    repeat does the same work and its time is the minimum over repeats (what the code costs,
    without the pauses other processes on a shared machine inject)."""
    runs = [
        run_once(impl, work, running, num_blocks, args, f"{desc} ({r + 1}/{args.repeats})")
        for r in range(args.repeats)
    ]
    first = runs[0]
    if any(r["shapes"] != first["shapes"] for r in runs[1:]):
        raise RuntimeError(f"{impl}: repeats scheduled differently; the workload must be deterministic")
    times = np.minimum.reduce([r["times"] for r in runs])
    steady = first["steady"]
    first.update(
        us_per_step=float(times[steady].mean()) if steady.any() else float("nan"),
        median_us_per_step=float(np.median(times[steady])) if steady.any() else float("nan"),
        mean_us_all_steps=float(times.mean()),
        total_s=float(times.sum() / 1e6),
    )
    return first


def run_once(impl: str, work, running: int, num_blocks: int, args, desc: str) -> dict:
    if impl == "cpp":
        cfg = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_num_seqs=running,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        )
        sched = Scheduler(cfg)
        for i, (prompt, max_tokens) in enumerate(work):
            sched.add_request(np.asarray(prompt, dtype=np.int32), seq_id=i, max_tokens=max_tokens)
    else:
        sched = PyScheduler(
            num_blocks, args.block_size, running, args.max_num_batched_tokens, args.max_model_len
        )
        for i, (prompt, max_tokens) in enumerate(work):
            sched.add_request(i, prompt, max_tokens)
    tokens = np.full(max(running, 1), 7, dtype=np.int32)  # the instant fake model's samples
    sizes, prefill, times, shapes = [], [], [], []
    clock = time.perf_counter_ns
    bar = tqdm(total=len(work), desc=desc, unit="req", leave=False, mininterval=0.5)
    gc.collect()
    gc.disable()  # as in the engine loop: no collector pauses in the timings
    try:
        while sched.has_unfinished() if impl == "cpp" else sched.num_unfinished > 0:
            t0 = clock()
            out = sched.schedule()
            if impl == "cpp":  # what a model runner reads: each a numpy view, no copies
                _ = (
                    out.input_ids,
                    out.positions,
                    out.slot_mapping,
                    out.block_tables,
                    out.seq_lens,
                    out.query_start_loc,
                )
                n = out.num_seqs
            else:
                n = len(out.seqs)
            t1 = clock()
            sampled = tokens[:n]
            t2 = clock()
            finished = sched.update_from_output(out, sampled)
            if impl == "cpp":
                for seq_id, _ in finished:
                    sched.release(seq_id)
            t3 = clock()
            times.append((t1 - t0 + t3 - t2) / 1000.0)
            sizes.append(n)
            prefill.append(out.any_prefill)
            shapes.append((n, out.num_batched_tokens))
            bar.update(len(finished))
    finally:
        gc.enable()
        bar.close()
    times_a, sizes_a, prefill_a = np.array(times), np.array(sizes), np.array(prefill)
    steady = (~prefill_a) & (sizes_a >= 0.9 * running)
    preemptions = sched.stats()["num_preemptions"] if impl == "cpp" else sched.num_preemptions
    return {
        "steps": len(times),
        "steady_decode_steps": int(steady.sum()),
        "steady": steady,
        "times": times_a,
        "preemptions": int(preemptions),
        "prefix_hit_rate": float(sched.stats()["prefix_cache_hit_rate"]) if impl == "cpp" else float("nan"),
        "shapes": shapes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024], help="max_num_seqs values")
    p.add_argument("--num-requests", type=int, default=3000)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=768)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--kv-fraction", type=float, default=0.85, help="KV pool size relative to the batch's need"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; per-step minimum is kept")
    p.add_argument("--no-baseline", action="store_true", help="skip the pure-Python baseline")
    p.add_argument("--quick", action="store_true", help="1000 requests (a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.num_requests = 1000
        args.repeats = 1

    rng = np.random.default_rng(args.seed)
    work = make_workload(args, rng)
    records = []
    for running in args.running:
        num_blocks = pool_blocks(work, running, args)
        cpp = run("cpp", work, running, num_blocks, args, f"C++ running={running}")
        rec = {
            "running": running,
            "us_per_step": round(cpp["us_per_step"], 2),
            "median_us_per_step": round(cpp["median_us_per_step"], 2),
            "mean_us_all_steps": round(cpp["mean_us_all_steps"], 2),
            "steps": cpp["steps"],
            "steady_decode_steps": cpp["steady_decode_steps"],
            "preemptions": cpp["preemptions"],
            "prefix_hit_rate": round(cpp["prefix_hit_rate"], 4),
            "num_blocks": num_blocks,
            "block_size": args.block_size,
            "num_requests": args.num_requests,
            "repeats": args.repeats,
        }
        if not args.no_baseline:
            py = run("python", work, running, num_blocks, args, f"Python running={running}")
            rec.update(
                python_us_per_step=round(py["us_per_step"], 2),
                python_mean_us_all_steps=round(py["mean_us_all_steps"], 2),
                python_preemptions=py["preemptions"],
                python_median_us_per_step=round(py["median_us_per_step"], 2),
                speedup_vs_python=round(py["us_per_step"] / cpp["us_per_step"], 2),
                median_speedup_vs_python=round(py["median_us_per_step"] / cpp["median_us_per_step"], 2),
                same_schedule_as_python=cpp["shapes"] == py["shapes"],
            )
        records.append(rec)

    table = Table(
        title=f"scheduler step time (schedule + update_from_output), {platform.processor() or 'cpu'}, "
        f"{args.num_requests} requests, block {args.block_size}"
    )
    cols = [
        "running",
        "us_per_step",
        "median_us_per_step",
        "mean_us_all_steps",
        "steady_decode_steps",
        "steps",
        "preemptions",
        "prefix_hit_rate",
    ]
    if not args.no_baseline:
        cols += [
            "python_us_per_step",
            "python_median_us_per_step",
            "speedup_vs_python",
            "median_speedup_vs_python",
            "same_schedule_as_python",
        ]
    short = {
        "us_per_step": "us/step",
        "median_us_per_step": "median us",
        "mean_us_all_steps": "us all steps",
        "steady_decode_steps": "steady steps",
        "prefix_hit_rate": "prefix hits",
        "python_us_per_step": "python us/step",
        "python_median_us_per_step": "python median",
        "speedup_vs_python": "speedup",
        "median_speedup_vs_python": "median speedup",
        "same_schedule_as_python": "same schedule",
    }
    for c in cols:
        table.add_column(short.get(c, c), justify="right")
    for r in records:
        table.add_row(*[str(r[c]) for c in cols])
    Console(width=200).print(table)
    print(
        "us_per_step: mean over steady decode steps (no prefill, >= 90% of max_num_seqs running) of each step's "
        "minimum time over the repeats; "
        f"native core: {build_info()}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
