"""Prefill and decode throughput of the paged runner vs the recompute runner, §11 tiny V4.1, on the CPU.

For each batch size: one prefill step of `--prompt-len` tokens per sequence (one logits row each), then
`--decode-steps` decode steps of one token per sequence, each sampled (temperature 0.8, seeded) with the
engine's `Sampler`. A step's time is split into: metadata (building the `StepBatch` and the runner's
step metadata), model forward, sampling. `outside_forward_frac` = (metadata + sampling) / step time
(goal < 0.10). The recompute runner (re-runs the stateless forward over each whole prefix) is the
in-run baseline; `speedup_vs_recompute` compares the same phase and batch size.
Prints a table and writes benchmarks/out/bench_cpu_runtime.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.runner import RecomputeRunner, StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.sampling import RowParams, Sampler
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_cpu_runtime.json"
RUNNERS = {"paged": PagedRunner, "recompute": RecomputeRunner}


def _run(model, kind: str, batch: int, prompt_len: int, decode_steps: int, block_size: int) -> list[dict]:
    blocks_per_seq = -(-(prompt_len + decode_steps) // block_size)
    runner = RUNNERS[kind](model, num_blocks=batch * blocks_per_seq, block_size=block_size)
    sampler = Sampler()
    tables = [np.arange(i * blocks_per_seq, (i + 1) * blocks_per_seq, dtype=np.int32) for i in range(batch)]
    rng = np.random.default_rng(0)
    seqs = rng.integers(4, model.config.vocab_size, (batch, prompt_len))
    ctx = prompt_len
    records = []
    for phase, steps in (("prefill", 1), ("decode", decode_steps)):
        t_meta = t_fwd = t_sample = 0.0
        tokens = 0
        for _ in range(steps):
            t0 = time.perf_counter()
            q = prompt_len if phase == "prefill" else 1
            start = ctx - q
            step = StepBatch.lockstep(tables, start, seqs[:, start:ctx])
            meta0 = getattr(runner, "metadata_s", 0.0)
            t1 = time.perf_counter()
            logits = runner.execute(step)
            t2 = time.perf_counter()
            rows = [RowParams(temperature=0.8, seed=i, position=ctx) for i in range(batch)]
            new = sampler(logits, rows).token_ids.numpy()
            t3 = time.perf_counter()
            meta = getattr(runner, "metadata_s", 0.0) - meta0
            t_meta += (t1 - t0) + meta
            t_fwd += (t2 - t1) - meta
            t_sample += t3 - t2
            tokens += batch * q
            if phase == "decode" or steps == 1:
                seqs = np.concatenate((seqs, new[:, None]), axis=1)
                ctx += 1
        total = t_meta + t_fwd + t_sample
        records.append(
            {
                "runner": kind,
                "phase": phase,
                "batch": batch,
                "prompt_len": prompt_len,
                "steps": steps,
                "tokens": tokens,
                "tok_per_s": round(tokens / total, 1),
                "ms_per_step": round(total / steps * 1e3, 2),
                "metadata_ms_per_step": round(t_meta / steps * 1e3, 3),
                "forward_ms_per_step": round(t_fwd / steps * 1e3, 2),
                "sample_ms_per_step": round(t_sample / steps * 1e3, 3),
                "outside_forward_frac": round((t_meta + t_sample) / total, 4),
            }
        )
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps after the prefill")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--runners", nargs="+", default=["paged", "recompute"], choices=sorted(RUNNERS))
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = p.parse_args()
    if args.prompt_len + args.decode_steps > 256:
        raise SystemExit("--prompt-len + --decode-steps must be <= 256 (the tiny config's max positions)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        make_v41_checkpoint(tmp, seed=0)
        model = load_v41(tmp)
    for kind in args.runners:  # warm-up (first-call allocations, lazy imports), not recorded
        _run(model, kind, 1, 4, 1, args.block_size)
    records = []
    jobs = [(k, b) for b in args.batches for k in args.runners]
    for kind, batch in tqdm(jobs, desc="bench_cpu_runtime"):
        records += _run(model, kind, batch, args.prompt_len, args.decode_steps, args.block_size)
    base = {(r["phase"], r["batch"]): r["tok_per_s"] for r in records if r["runner"] == "recompute"}
    for r in records:
        b = base.get((r["phase"], r["batch"]))
        r["speedup_vs_recompute"] = round(r["tok_per_s"] / b, 2) if b else None

    cols = [
        "runner",
        "phase",
        "batch",
        "tok_per_s",
        "ms_per_step",
        "metadata_ms_per_step",
        "forward_ms_per_step",
        "sample_ms_per_step",
        "outside_forward_frac",
        "speedup_vs_recompute",
    ]
    table = Table(
        title=f"§11 tiny V4.1 runners, prompt {args.prompt_len}, {args.decode_steps} decode steps, "
        f"{args.threads} thread(s)"
    )
    for c in cols:
        table.add_column(c, justify="right")
    for r in records:
        table.add_row(*(str(r[c]) for c in cols))
    Console().print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
