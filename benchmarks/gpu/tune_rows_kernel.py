"""Block shapes of batch-invariant mode's row kernel for the LM head, against cuBLAS, on the device.

Why: at batch 8 the mode's row kernel (`backends/nvidia/triton_rows.py`) takes 284 us for the tiny model's LM
head ([8, 128] x [128, 129,280], FP64 accumulation) where cuBLAS's FP64 GEMM takes 75 us; wider column blocks
barely changed it. This times a copy of the kernel's body that takes both weight strides as arguments (the
shipped kernel fixes K's stride to 1), at other column / K block sizes and warp counts, with the weight as
stored and transposed ([K, N], N contiguous, so a thread can keep K to itself), for the weight dtypes the
model may store. Each variant also records whether a row's bits are the same at M = 1 and M = 8 (the
property the mode relies on) and its largest error against an FP64 product.

    python benchmarks/gpu/tune_rows_kernel.py [--rows 8] [--n 129280] [--k 128]

Prints a table and writes benchmarks/out/tune_rows_kernel.json (one record per variant and dtype).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parents[1] / "out" / "tune_rows_kernel.json"


@triton.jit(do_not_specialize=["m", "n", "k", "s_xm", "s_wk", "s_wn", "s_om"])
def _rows(x_ptr, w_ptr, out_ptr, m, n, k, s_xm, s_wk, s_wn, s_om, BN: tl.constexpr, BK: tl.constexpr):
    # the mode's row kernel with both weight strides free: one row against BN columns, BK-wide products
    # summed in K order (s_wk = 1: the stored [N, K] weight; s_wn = 1: a transposed [K, N] copy)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BN,), dtype=tl.float64)
    for k0 in range(0, k, BK):
        kk = k0 + ks
        a = tl.load(x_ptr + row * s_xm + kk, mask=kk < k, other=0.0).to(tl.float64)
        b_ptrs = w_ptr + kk[:, None].to(tl.int64) * s_wk + cols[None, :].to(tl.int64) * s_wn
        b = tl.load(b_ptrs, mask=(kk[:, None] < k) & (cols[None, :] < n), other=0.0).to(tl.float64)
        acc += tl.sum(a[:, None] * b, axis=0)
    tl.store(out_ptr + row * s_om + cols, acc, mask=cols < n)


def _run(x, w, transposed: bool, bn: int, bk: int, warps: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[1] if transposed else w.shape[0]
    out = torch.empty(m, n, dtype=torch.float64, device=x.device)
    s_wk, s_wn = (w.stride(0), 1) if transposed else (1, w.stride(0))
    _rows[(m, -(-n // bn))](
        x, w, out, m, n, k, x.stride(0), s_wk, s_wn, out.stride(0), BN=bn, BK=bk, num_warps=warps
    )
    return out


VARIANTS = [  # (layout, BN, BK, warps); the first is the kernel as it ships for wide weights
    ("stored", 128, 32, 4),
    ("stored", 16, 128, 4),
    ("stored", 64, 64, 4),
    ("stored", 256, 16, 4),
    ("stored", 128, 32, 8),
    ("stored", 32, 128, 4),
    ("transposed", 128, 32, 4),
    ("transposed", 256, 16, 4),
    ("transposed", 512, 8, 4),
    ("transposed", 256, 32, 8),
    ("transposed", 1024, 4, 4),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--n", type=int, default=129_280)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.k, generator=g, dtype=torch.float64).to(dev)
    records = []
    for w_dtype in (torch.bfloat16, torch.float32):
        w = (torch.randn(args.n, args.k, generator=g) * args.k**-0.5).to(w_dtype).to(dev)
        w_t = w.t().contiguous()
        ref = x @ w.double().t()
        w64 = w.double()
        cublas_us = 1e3 * triton.testing.do_bench(lambda w64=w64: x @ w64.t(), warmup=25, rep=200)
        for layout, bn, bk, warps in VARIANTS:
            ww = w_t if layout == "transposed" else w
            out = _run(x, ww, layout == "transposed", bn, bk, warps)
            one = _run(x[3:4].contiguous(), ww, layout == "transposed", bn, bk, warps)
            invariant = bool(torch.equal(one[0], out[3]))
            err = float(((out - ref).abs().max() / ref.abs().max()).item())
            us = 1e3 * triton.testing.do_bench(
                lambda ww=ww, layout=layout, bn=bn, bk=bk, warps=warps: _run(
                    x, ww, layout == "transposed", bn, bk, warps
                ),
                warmup=25,
                rep=200,
            )
            records.append(
                {
                    "weight_dtype": str(w_dtype).removeprefix("torch."),
                    "layout": layout,
                    "block_n": bn,
                    "block_k": bk,
                    "num_warps": warps,
                    "rows": args.rows,
                    "n": args.n,
                    "k": args.k,
                    "us_per_call": us,
                    "cublas_fp64_us_per_call": cublas_us,
                    "vs_cublas": us / cublas_us,
                    "row_invariant": invariant,
                    "max_rel_err": err,
                }
            )
    table = Table(title=f"row kernel for [{args.rows}, {args.k}] x [{args.k}, {args.n}] (FP64 accumulation)")
    for col in ("weight", "layout", "BN", "BK", "warps", "us", "x cuBLAS FP64", "M-invariant", "rel err"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            r["weight_dtype"], r["layout"], str(r["block_n"]), str(r["block_k"]), str(r["num_warps"]),
            f"{r['us_per_call']:.1f}", f"{r['vs_cublas']:.2f}", str(r["row_invariant"]), f"{r['max_rel_err']:.1e}",
        )  # fmt: skip
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
