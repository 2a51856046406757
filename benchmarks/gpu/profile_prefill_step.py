"""Where an eager prefill step's time goes on the GPU, default vs batch-invariant mode, per batch size.

For each (batch, mode): a `PagedRunner` prefills `--context` tokens per sequence (`--repeats` timed steps on
the same block tables, after a warm-up). Reported per step: `step_ms` (wall clock, the step ends with the
logits read back; median), kernel launches and summed kernel time (torch profiler), host-side ATen calls,
and the ops with the most calls and the most host time (in `<out>.txt`); `step_cost_pct` compares the
batch-invariant step with the default one of the same batch.

    python benchmarks/gpu/profile_prefill_step.py [--model PATH] [--batches 1 8] [--context 64]
writes benchmarks/out/profile_prefill_step.json (flat records) and profile_prefill_step.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_step import MODES, RESULTS, _kernel_table, add_model_args, load_profiled_model  # noqa: E402


def _host_table(prof, steps: int):
    rows = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()]
    rows = [r for r in rows if r[0].startswith("aten::")]
    return sum(r[2] for r in rows), rows


def profile_one(model, b: int, mode: str, args) -> tuple[dict, list, list]:
    from deepinfer_model.runner import StepBatch
    from deepinfer_model.runtime import PagedRunner

    os.environ["DEEPINFER_BATCH_INVARIANT"] = MODES[mode]
    cuda = args.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    block = 16
    per_seq = -(-args.context // block)
    runner = PagedRunner(model, num_blocks=b * per_seq, block_size=block)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(b)]
    prompt = np.random.default_rng(0).integers(1000, 90_000, (b, args.context))

    def step():
        torch.argmax(runner.execute(StepBatch.lockstep(tables, 0, prompt)), -1).tolist()

    step()  # warm-up: weight caches, kernel compiles
    walls = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        step()
        walls.append((time.perf_counter() - t0) * 1e3)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync()
    kernels, kernel_ms, krows = _kernel_table(prof, 1, cuda)
    calls, hrows = _host_table(prof, 1)
    srows = []
    if args.stacks:  # again, with Python stacks: which source lines the device time comes from
        # (verbose: without it this torch leaves the events' stacks empty)
        verbose = torch._C._profiler._ExperimentalConfig(verbose=True)
        with torch.profiler.profile(
            activities=activities, with_stack=True, experimental_config=verbose
        ) as sprof:
            step()
            sync()
        srows = _stack_table(sprof, args.stacks, cuda)
    runner.close()
    rec = {
        "model": args.model_name,
        "mode": mode,
        "batch": b,
        "context": args.context,
        "step_ms": float(np.median(walls)),
        "kernels_per_step": round(kernels, 1),
        "kernel_ms": kernel_ms,
        "aten_calls_per_step": round(calls, 1),
    }
    return rec, krows, hrows, srows


def _stack_table(prof, depth: int, cuda: bool) -> list[tuple[str, float, float, str]]:
    """(ATen op, self device ms, calls, the project's frames of its Python stack), most device time first
    (on the CPU, the script's dry run: self host time)."""
    rows = []
    for e in prof.key_averages(group_by_stack_n=depth):
        if cuda:
            ms = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)) / 1e3
        else:
            ms = e.self_cpu_time_total / 1e3
        if ms <= 0 or not e.key.startswith("aten::"):
            continue
        frames = [f.split("/src/")[-1] for f in e.stack if "deepinfer" in f and "profiler" not in f]
        rows.append((e.key, ms, e.count, " < ".join(frames[:depth])))
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--repeats", type=int, default=5, help="timed prefill steps per configuration")
    ap.add_argument("--top", type=int, default=20, help="ops listed per configuration")
    ap.add_argument("--device", default="cuda", help="cuda[:N]; cpu: a dry run of the script")
    ap.add_argument(
        "--stacks",
        type=int,
        default=0,
        help="also profile one step with Python stacks and list the ATen ops with the most device time per "
        "source location (this many frames; 0: off)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "profile_prefill_step.json")
    args = ap.parse_args()
    model = load_profiled_model(args, ap)
    from rich.console import Console
    from rich.table import Table

    before = os.environ.get("DEEPINFER_BATCH_INVARIANT")
    records, text = [], []
    try:
        for b in args.batches:
            for mode in args.modes:
                rec, krows, hrows, srows = profile_one(model, b, mode, args)
                records.append(rec)
                text.append(f"== {args.model_name} {mode} batch {b}: {rec['step_ms']:.2f} ms, "
                            f"{rec['kernels_per_step']:.0f} kernels {rec['kernel_ms']:.2f} ms, "
                            f"{rec['aten_calls_per_step']:.0f} aten calls")  # fmt: skip
                text += [
                    f"  kernel {ms:8.3f} ms {n:7.1f}x  {name[:140]}" for name, ms, n in krows[: args.top]
                ]
                for name, ms, n in sorted(hrows, key=lambda r: -r[2])[: args.top]:
                    text.append(f"  calls  {ms:8.3f} ms {n:7.1f}x  {name}")
                for name, ms, n, where in srows[: args.top]:
                    text.append(f"  source {ms:8.3f} ms {n:7.0f}x  {name}  {where}")
    finally:
        if before is None:
            os.environ.pop("DEEPINFER_BATCH_INVARIANT", None)
        else:
            os.environ["DEEPINFER_BATCH_INVARIANT"] = before
    for rec in records:
        base = [r for r in records if r["batch"] == rec["batch"] and r["mode"] == "default"]
        if base:  # (--modes without default: no cost column)
            rec["step_cost_pct"] = 100.0 * (rec["step_ms"] / base[0]["step_ms"] - 1.0)
    table = Table(title=f"eager prefill step ({args.model_name}, {args.device}, context {args.context})")
    cols = (
        "mode",
        "batch",
        "step_ms",
        "step_cost_pct",
        "kernels_per_step",
        "kernel_ms",
        "aten_calls_per_step",
    )
    for c in cols:
        table.add_column(c, justify="right")
    for r in records:
        cells = (r.get(c, "-") for c in cols)
        table.add_row(*(f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells))
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    args.out.with_suffix(".txt").write_text("\n".join(text) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
