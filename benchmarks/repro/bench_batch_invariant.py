"""Cost of batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1) against the default mode (CPU, or `--device
cuda`: the model, KV pools and steps on the GPU, wall clock; every step reads its tokens back, so it ends
synchronised).

The default deepinfer-tiny model on the paged runner: for each batch size, one prefill step of
`--prompt-len` tokens per sequence, then `--decode-steps` decode steps of one token per sequence.
Both modes run step by step side by side (same process, same inputs, a runner and KV cache each): every
step runs in the default and then in the invariant mode or the other way round (alternating), so load that
comes and goes on the machine hits both steps of a pair alike (pairing whole runs instead scattered the
batch-8 decode pairs from -25% to +54% on the shared CPU host). `cost_pct` = the median over all pairs
(one per prefill step, one per decode step, of every repeat) of (invariant / default - 1) * 100 for the
same phase and batch size (goal < 15), with the spread of the paired values (`cost_pct_min` /
`cost_pct_max`); `ms_per_step` is the median step time. Also checks that both
modes gave the same greedy tokens. `--clock cpu` times the process's CPU time instead of wall time
(on a shared, loaded host the wall-clock pairs scatter widely). `--cuda-graphs` (CUDA): decode steps
replay CUDA graphs in both modes (one runner per batch size and mode, captured in the warm-up), prefill
stays eager.
Prints a table and writes benchmarks/out/bench_batch_invariant.json.
"""

from __future__ import annotations

import argparse
import json
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
    restored_mode,
    set_mode,
)
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_batch_invariant.json"


def _runner(model, batch: int, prompt_len: int, decode_steps: int, block_size: int, graphs: bool):
    per_seq = -(-(prompt_len + decode_steps) // block_size)
    settings = None
    if graphs:
        from deepinfer_model.runtime.cuda_graphs import DecodeGraphSettings

        settings = DecodeGraphSettings(batch, per_seq * block_size)
    return PagedRunner(model, num_blocks=batch * per_seq, block_size=block_size, decode_graphs=settings)


def _lockstep(
    runners: dict, batch: int, prompt_len: int, decode_steps: int, block_size: int, clock, flip: int
):
    """One prefill step and `decode_steps` decode steps in both modes, paired step by step: each step runs in
    the default and in the invariant runner back to back (which first alternates step by step, `flip`
    shifts it), each runner on its own KV cache and its own greedy tokens. A step is timed up to its
    tokens read back (a GPU step ends synchronised). -> ({mode: {phase: [seconds per step]}}, {mode: tokens})"""
    per_seq = -(-(prompt_len + decode_steps) // block_size)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(batch)]
    ids = np.random.default_rng(0).integers(1000, 90_000, (batch, prompt_len))
    times = {m: {"prefill": [], "decode": []} for m in MODES}
    tokens: dict[str, list] = {m: [] for m in MODES}
    order, ctx = list(MODES), 0
    for step, (phase, q) in enumerate([("prefill", prompt_len)] + [("decode", 1)] * decode_steps):
        for mode in order if (step + flip) % 2 == 0 else order[::-1]:
            set_mode(mode)
            step_ids = ids if phase == "prefill" else np.array(tokens[mode][-1])[:, None]
            t0 = clock()
            logits = runners[mode].execute(StepBatch.lockstep(tables, ctx, step_ids))
            tokens[mode].append(torch.argmax(logits, dim=-1).tolist())
            times[mode][phase].append(clock() - t0)
        ctx += q
    return times, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--cuda-graphs", action="store_true", help="decode through CUDA graphs in both modes (CUDA)"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help=f"results JSON (default {RESULTS.name}, _cuda on a GPU)"
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (time.process_time), which does not count "
        "the time other processes hold the core (on a shared, loaded host the wall-clock pairs scatter)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type != "cpu" and args.clock == "cpu":
        ap.error("--clock cpu measures host CPU time: use --clock wall with --device cuda")
    if args.cuda_graphs and device.type != "cuda":
        ap.error("--cuda-graphs needs --device cuda")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(None)[0], torch.float32, device=device)
    samples: dict[tuple, list[float]] = {}
    same_tokens = {}
    shape = (args.prompt_len, args.decode_steps, args.block_size)
    with restored_mode():
        # graphs are captured under one mode: a runner per (batch, mode), kept; eager: fresh runners per repeat
        kept = {
            (b, mode): _runner(model, b, *shape, args.cuda_graphs) for b in args.batch_sizes for mode in MODES
        } if args.cuda_graphs else None  # fmt: skip

        def runners_for(b):
            return {m: kept[(b, m)] if kept else _runner(model, b, *shape, False) for m in MODES}

        # warm-up (not timed): weight caches of both modes, allocator, first-call costs, graph captures
        for b in args.batch_sizes if kept else [max(args.batch_sizes)]:
            _lockstep(runners_for(b), b, *shape, clock, 0)
        work = [(b, r) for b in args.batch_sizes for r in range(args.repeats)]
        for b, r in tqdm(work, desc="bench", unit="run"):
            times, tokens = _lockstep(runners_for(b), b, *shape, clock, r)
            same_tokens[b] = same_tokens.get(b, True) and tokens["default"] == tokens["batch_invariant"]
            for mode in MODES:
                for phase, secs in times[mode].items():
                    samples.setdefault((b, mode, phase), []).extend(secs)

    records = []
    for b in args.batch_sizes:
        for phase in ("prefill", "decode"):
            base = np.array(samples[(b, "default", phase)])
            for mode in MODES:
                runs = np.array(samples[(b, mode, phase)])  # seconds per step
                sec = float(np.median(runs))
                paired = 100.0 * (runs / base - 1.0)
                tokens_per_step = b * (args.prompt_len if phase == "prefill" else 1)
                records.append(
                    {
                        "mode": mode,
                        "phase": phase,
                        "batch": b,
                        "prompt_len": args.prompt_len,
                        "threads": args.threads,
                        "clock": args.clock,
                        "device": device.type,
                        "cuda_graphs": args.cuda_graphs,
                        "tokens_per_step": tokens_per_step,
                        "tok_per_s": tokens_per_step / sec,
                        "ms_per_step": 1e3 * sec,
                        "cost_pct": float(np.median(paired)),
                        "cost_pct_min": float(paired.min()),
                        "cost_pct_max": float(paired.max()),
                        "repeats": args.repeats,
                        "pairs": len(runs),
                        "same_greedy_tokens": same_tokens[b],
                    }
                )
    graphs = ", decode CUDA graphs" if args.cuda_graphs else ""
    table = Table(title=f"batch-invariant mode vs default (paged runner, deepinfer-tiny, {device}{graphs})")
    for col in ("phase", "batch", "mode", "tok/s", "ms/step", "cost % (median)", "spread", "same tokens"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            r["phase"],
            str(r["batch"]),
            r["mode"],
            f"{r['tok_per_s']:.1f}",
            f"{r['ms_per_step']:.1f}",
            f"{r['cost_pct']:+.1f}",
            f"{r['cost_pct_min']:+.0f}..{r['cost_pct_max']:+.0f}",
            str(r["same_greedy_tokens"]),
        )
    Console().print(table)
    suffix = "" if device.type == "cpu" else f"_{device.type}" + ("_graphs" if args.cuda_graphs else "")
    out = args.out or RESULTS.with_name(f"{RESULTS.stem}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
