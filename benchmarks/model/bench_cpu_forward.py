"""Time the stateless DeepSeek-V4.1 forward of the spec §11 tiny config on the CPU.

Writes a random quantised §11 checkpoint (real DeepSeek-V4 tokenizer for Engram), loads it, and times
`model.forward(tokens)` (and with a drafted block) over `--tokens` tokens for each thread count.
Prints a table and writes benchmarks/out/bench_cpu_forward.json (one flat record per configuration;
`ratio_vs_baseline` is relative to the first configuration: 1 thread, FP32 activations, no draft).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_cpu_forward.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _time(fn, repeats: int) -> tuple[float, float]:
    """(median wall ms, median process-CPU ms) over `repeats` calls after one warm-up call."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=96, help="sequence length of the forward (default 96)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per configuration (median reported)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op thread counts")
    p.add_argument(
        "--act-dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=sorted(DTYPES),
        help="activation dtypes (rounding points) to time",
    )
    p.add_argument("--draft-tokens", type=int, default=4, help="drafted block length for the '+draft' rows")
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = p.parse_args()
    if not 1 <= args.tokens <= 256:
        raise SystemExit("--tokens must lie in [1, 256] (the tiny config's max_position_embeddings)")

    with tempfile.TemporaryDirectory() as tmp:
        make_v41_checkpoint(tmp, seed=0)
        models = {name: load_v41(tmp, act_dtype=dt) for name, dt in DTYPES.items() if name in args.act_dtypes}
    tokens = torch.randint(4, 256, (args.tokens,), generator=torch.Generator().manual_seed(0))
    saved_threads = torch.get_num_threads()
    records = []
    for dtype_name in args.act_dtypes:
        model = models[dtype_name]
        for threads in args.threads:
            torch.set_num_threads(threads)
            for draft in (0, args.draft_tokens):
                wall, cpu = _time(
                    lambda m=model, d=draft: m.forward(tokens, num_draft_tokens=d), args.repeats
                )
                records.append(
                    {
                        "config": "v41-tiny-s11",
                        "tokens": args.tokens,
                        "threads": threads,
                        "act_dtype": dtype_name,
                        "draft_tokens": draft,
                        "ms_per_forward": round(wall, 2),
                        "cpu_ms_per_forward": round(cpu, 2),
                        "tok_per_s": round(args.tokens / wall * 1e3, 1),
                    }
                )
    torch.set_num_threads(saved_threads)
    base = records[0]["ms_per_forward"]
    for r in records:
        r["ratio_vs_baseline"] = round(r["ms_per_forward"] / base, 3)

    table = Table(title=f"V4.1 §11 tiny stateless forward, {args.tokens} tokens (median of {args.repeats})")
    for col in (
        "act_dtype",
        "threads",
        "draft_tokens",
        "ms_per_forward",
        "cpu_ms_per_forward",
        "tok_per_s",
        "ratio_vs_baseline",
    ):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            *(
                str(r[c])
                for c in (
                    "act_dtype",
                    "threads",
                    "draft_tokens",
                    "ms_per_forward",
                    "cpu_ms_per_forward",
                    "tok_per_s",
                    "ratio_vs_baseline",
                )
            )
        )
    Console().print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
