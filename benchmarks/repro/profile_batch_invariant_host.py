"""Where batch-invariant mode's extra host time goes: Python functions profiled in both modes, ranked by the
change of their own time (cProfile `tottime`, per step).

The default deepinfer-tiny model on the paged runner, as `bench_batch_invariant.py` runs it (eager steps):
for each batch size, one prefill step of `--prompt-len` tokens per sequence and `--decode-steps` decode
steps. Each mode runs `--repeats` times under cProfile, the modes alternating; a function's `default_ms` /
`bi_ms` are its own time per step (a torch op called from Python counts as a built-in function of its own;
`x @ w` and other operators do not, so their time is their caller's). On a GPU the step is bound by host
time (launches, Python), which is what this ranks; `--launches` also times one launch of each Triton kernel
of the mode against a torch op of the same shape (the host time the step pays per kernel), and the LM
head's product at batch 8 on the device (the row kernel against cuBLAS).

    python benchmarks/repro/profile_batch_invariant_host.py [--device cuda] [--batch-sizes 1 8] [--top 25]
Prints a table per (phase, batch) and writes benchmarks/out/profile_batch_invariant_host[_cuda].json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import numpy as np
import torch
from deepinfer.default_model import resolve_model
from deepinfer_model import load_model
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from paired_modes import (  # (this folder: the script's path)
    MODES,
    add_workload_args,
    paired_work,
    restored_mode,
    set_mode,
)
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parents[1] / "out" / "profile_batch_invariant_host.json"
PHASES = ("prefill", "decode")


def _steps(model, batch: int, prompt_len: int, decode_steps: int, profilers: dict) -> None:
    """One prefill and `decode_steps` decode steps; `profilers[phase]` is enabled around that phase's
    `execute` calls only (the token read-back included: it is where a GPU step waits for its kernels)."""
    block = 16
    per_seq = -(-(prompt_len + decode_steps) // block)
    runner = PagedRunner(model, num_blocks=batch * per_seq, block_size=block)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]
    ids = np.random.default_rng(0).integers(1000, 90_000, (batch, prompt_len))
    ctx, tokens = 0, None
    for phase, count in (("prefill", 1), ("decode", decode_steps)):
        for _ in range(count):
            step_ids = ids if phase == "prefill" else np.array(tokens)[:, None]
            prof = profilers.get(phase)
            if prof:
                prof.enable()
            logits = runner.execute(StepBatch.lockstep(tables, ctx, step_ids))
            tokens = torch.argmax(logits, dim=-1).tolist()
            if prof:
                prof.disable()
            ctx += step_ids.shape[1]


def _own_times(prof: cProfile.Profile) -> dict[str, float]:
    out: dict[str, float] = {}
    for (path, line, name), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(prof).stats.items():
        key = name if path == "~" else f"{Path(path).name}:{line}:{name}"
        out[key] = out.get(key, 0.0) + tottime
    return out


def _time_launches(device: torch.device, n: int = 200) -> list[dict]:
    """Host time per call of the mode's Triton kernels (tiny shapes: launch-bound) and of the torch ops the
    default mode calls for the same products."""
    from deepinfer_model.ops.registry import get_ops

    ops = get_ops()
    x = torch.randn(8, 128, dtype=torch.float64, device=device)
    w = torch.randn(128, 128, dtype=torch.float64, device=device)
    a = torch.randn(40, 8, 32, dtype=torch.float64, device=device)
    b = torch.randn(40, 32, 129, dtype=torch.float64, device=device)
    cases = {
        "rows_matmul [8,128]x[128,128]": lambda: ops.rows_matmul(x, w),
        "torch mm [8,128]x[128,128]": lambda: x @ w.t(),
        "tile_bmm 40 x [8,32]x[32,129]": lambda: ops.tile_bmm(a, b, None, None),
        "torch bmm 40 x [8,32]x[32,129]": lambda: torch.bmm(a, b),
    }
    out = []
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        out.append({"record": "launch", "op": name, "clock": "host", "us_per_call": 1e6 * host})
    # device time of the LM head's product at decode (8 rows, the tiny model's [129280, 128] head)
    head = torch.randn(129_280, 128, device=device)
    rows8 = torch.randn(8, 128, dtype=torch.float64, device=device)
    head64 = head.double()
    for name, fn in {
        "rows_matmul LM head [8,128]x[128,129280] (device)": lambda: ops.rows_matmul(rows8, head),
        "torch mm LM head [8,128]x[128,129280] fp64 (device)": lambda: rows8 @ head64.t(),
    }.items():
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        us = 1e3 * start.elapsed_time(end) / 20
        out.append({"record": "launch", "op": name, "clock": "device", "us_per_call": us})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--top", type=int, default=25, help="functions per table (by |change|)")
    ap.add_argument("--launches", action="store_true", help="also time single Triton / torch launches (CUDA)")
    ap.add_argument(
        "--out", type=Path, default=None, help=f"results JSON (default {RESULTS.name}, _cuda on a GPU)"
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.launches and device.type != "cuda":
        ap.error("--launches needs --device cuda")
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(None)[0], torch.float32, device=device)
    shape = (args.prompt_len, args.decode_steps)
    totals: dict[tuple, dict[str, float]] = {}
    with restored_mode():
        for mode in MODES:  # warm-up (not profiled): weight caches of both modes, kernels compiled
            set_mode(mode)
            _steps(model, max(args.batch_sizes), *shape, {})
        work = paired_work(args.batch_sizes, args.repeats)
        for b, _r, mode in tqdm(work, desc="profile", unit="run"):
            set_mode(mode)
            profs = {phase: cProfile.Profile() for phase in PHASES}
            _steps(model, b, *shape, profs)
            for phase, prof in profs.items():
                acc = totals.setdefault((b, mode, phase), {})
                for k, v in _own_times(prof).items():
                    acc[k] = acc.get(k, 0.0) + v

    records = []
    console = Console()
    for b in args.batch_sizes:
        for phase in PHASES:
            steps = args.repeats * (1 if phase == "prefill" else args.decode_steps)
            d, bi = totals[(b, "default", phase)], totals[(b, "batch_invariant", phase)]
            rows = []
            for name in set(d) | set(bi):
                d_ms, bi_ms = 1e3 * d.get(name, 0.0) / steps, 1e3 * bi.get(name, 0.0) / steps
                rows.append((bi_ms - d_ms, d_ms, bi_ms, name))
            rows.sort(key=lambda r: -abs(r[0]))
            total_d, total_bi = sum(r[1] for r in rows), sum(r[2] for r in rows)
            table = Table(
                title=f"{phase}, batch {b} ({device}): own time per step, profiled "
                f"{total_d:.1f} -> {total_bi:.1f} ms ({100 * (total_bi / total_d - 1):+.1f}%)"
            )
            for col in ("function", "default ms", "BI ms", "change ms"):
                table.add_column(col, justify="right" if col != "function" else "left")
            for diff, d_ms, bi_ms, name in rows[: args.top]:
                table.add_row(name, f"{d_ms:.3f}", f"{bi_ms:.3f}", f"{diff:+.3f}")
                records.append(
                    {
                        "record": "function",
                        "phase": phase,
                        "batch": b,
                        "device": device.type,
                        "function": name,
                        "default_ms_per_step": d_ms,
                        "bi_ms_per_step": bi_ms,
                        "change_ms_per_step": diff,
                    }
                )
            records.append(
                {
                    "record": "total",
                    "phase": phase,
                    "batch": b,
                    "device": device.type,
                    "function": "(all profiled)",
                    "default_ms_per_step": total_d,
                    "bi_ms_per_step": total_bi,
                    "change_ms_per_step": total_bi - total_d,
                }
            )
            console.print(table)
    if args.launches:
        launches = _time_launches(device)
        table = Table(title="time per call: host (tiny shapes: the launch) and device (the LM head)")
        table.add_column("op", justify="left")
        table.add_column("clock", justify="left")
        table.add_column("us / call", justify="right")
        for r in launches:
            table.add_row(r["op"], r["clock"], f"{r['us_per_call']:.1f}")
        console.print(table)
        records += launches
    out = args.out or RESULTS.with_name(
        f"{RESULTS.stem}{'' if device.type == 'cpu' else '_' + device.type}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
