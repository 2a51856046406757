"""Prefill throughput and estimated FLOPs of YOCO truncation modes on the CPU tiny V4.1 (spec §11).

Writes a random quantised §11 checkpoint (max_position_embeddings raised to the longest prompt), then
for each prompt length times one whole-prompt prefill (`model.forward(ids, logit_rows=[-1])`, the sampled
row only) with truncation `off`, `mask` and `compact` (KEEP = --keep, default W + B = 14), and
estimates its FP8-equivalent FLOPs with `deepinfer_model.models.deepseek_v41.yoco.prefill_flops`.
Prints a table and writes benchmarks/out/bench_yoco.json (one flat record per prompt length and
mode; ratios are against `off` at the same length, measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint, tiny_v41_config_dict
from deepinfer_model.models.deepseek_v41.yoco import prefill_flops
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_yoco.json"
MODES = ("off", "mask", "compact")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 1024, 2048], help="prompt lengths")
    p.add_argument("--keep", type=int, default=14, help="KEEP (>= W + B = 8 + 6 on the tiny config)")
    p.add_argument("--repeats", type=int, default=1, help="timed prefills per configuration (median)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument(
        "--act-dtype", choices=["float32", "bfloat16"], default="float32", help="activation rounding"
    )
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = tiny_v41_config_dict()
    cfg["text_config"]["max_position_embeddings"] = max(256, max(args.prompt_lens))
    act = torch.bfloat16 if args.act_dtype == "bfloat16" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        make_v41_checkpoint(tmp, cfg, seed=0)
        model = load_v41(tmp, act_dtype=act)
    records = []
    jobs = [(n, m) for n in args.prompt_lens for m in MODES]
    base: dict[int, dict] = {}
    for n, mode in tqdm(jobs, desc="prefills"):
        ids = torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(n))
        kw = {} if mode == "off" else {"yoco_keep_tokens": args.keep, "yoco_mode": mode}
        model.forward(ids[:64], logit_rows=[-1], **kw)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model.forward(ids, logit_rows=[-1], **kw)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        fl = prefill_flops(model.config, 0, n, n, None if mode == "off" else args.keep, mode)
        rec = {
            "prompt_tokens": n,
            "mode": mode,
            "keep_tokens": args.keep if mode != "off" else 0,
            "consumer_rows": fl.consumer_rows,
            "ms_per_prefill": s * 1e3,
            "tok_per_s": n / s,
            "est_gflop_fp8eq": fl.total / 1e9,
            "est_consumer_gflop_fp8eq": fl.consumer / 1e9,
        }
        if mode == "off":
            base[n] = rec
        rec["speedup_vs_off"] = rec["tok_per_s"] / base[n]["tok_per_s"]
        rec["flops_ratio_vs_off"] = rec["est_gflop_fp8eq"] / base[n]["est_gflop_fp8eq"]
        records.append(rec)
    table = Table(
        title=f"YOCO prefill, CPU tiny V4.1 ({args.act_dtype}, {args.threads} thread(s), KEEP {args.keep})"
    )
    for c in ("prompt", "mode", "consumer rows", "ms", "tok/s", "x vs off", "est. GFLOP", "FLOPs vs off"):
        table.add_column(c, justify="right")
    for r in records:
        table.add_row(
            str(r["prompt_tokens"]),
            r["mode"],
            str(r["consumer_rows"]),
            f"{r['ms_per_prefill']:.0f}",
            f"{r['tok_per_s']:.0f}",
            f"{r['speedup_vs_off']:.2f}",
            f"{r['est_gflop_fp8eq']:.3f}",
            f"{r['flops_ratio_vs_off']:.3f}",
        )
    Console().print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
