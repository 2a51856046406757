"""The mHC mixes op on the GPU: torch FP32 version, TileLang epilogue and Triton kernel, per token count.

Each implementation gets the same trunk [T, m, H] (BF16, the medium / flagship V4.1's m = 4, H = 4096) and
is timed with CUDA events (median of `--repeats` calls after a warm-up): `us_per_call` replays the call captured
in a CUDA graph (the device's time, as in a graphed decode step), `eager_us_per_call` calls it (the host's
launch overhead included). The torch version is the in-run
baseline: `speedup_vs_torch` = its time over the row's. Every implementation is also checked against the
CPU reference (relative error, FP64), so a fast wrong kernel shows up in the table.

    python benchmarks/gpu/bench_mhc_mixes.py [--tokens 1 8 64 4096 16384] [--hidden 4096]
        [--project-tokens 16384] [--project-configs 64x64x4 64x128x4 ...]
writes benchmarks/out/bench_mhc_mixes.json (one flat record per implementation and token count).

The prefill projection alone (`triton_mhc.project`: the 16-bit trunk times fn, FP32 result, and the row sums
of squares) is swept over its launch (tokens per program, columns per chunk, warps) at `--project-tokens`, against cuBLAS's FP32
GEMM on the widened trunk plus torch's sum of squares (the path it replaced) as the in-run baseline; its
error is measured over every row against the FP64 product (impl `project/...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_step import RESULTS, _median_ms  # noqa: E402


def _graphed(fn):
    """`fn` captured in a CUDA graph (as the decode step runs it), so the timing is the device's, not the
    host's launch overhead (an eager call at few tokens is host-bound)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _median_us(fn, repeats: int) -> float:
    fn()  # (a warm-up call: the first eager call compiles or loads the kernel)
    return _median_ms(fn, repeats, True) * 1e3


def _implementations() -> dict:
    from deepinfer_model.backends.nvidia import torch_cuda

    impls = {"torch": torch_cuda.hc_mixes}
    try:
        from deepinfer_model.backends.nvidia import tilelang_mhc

        impls["tilelang"] = tilelang_mhc.hc_mixes
    except ImportError:
        pass
    try:
        from deepinfer_model.backends.nvidia import triton_mhc

        impls["triton"] = triton_mhc.hc_mixes
    except ImportError:
        pass
    return impls


def _project_sweep(args, fn_d: torch.Tensor, gen: torch.Generator) -> list[dict]:
    """`triton_mhc.project` per launch config vs the widened-trunk cuBLAS FP32 GEMM + sum of squares."""
    from deepinfer_model.backends.nvidia import triton_mhc

    records = []
    m, h = args.streams, args.hidden
    for t in args.project_tokens:
        trunk = (torch.randn(t, m, h, generator=gen) * 2).to(torch.bfloat16).cuda()
        flat64 = trunk.double().flatten(1)
        z64, ss64 = flat64 @ fn_d.double().t(), flat64.square().sum(1)
        del flat64

        def widened(x=trunk):
            flat = x.float().flatten(1)
            return flat @ fn_d.t(), flat.square().sum(1)

        impls = {"torch": widened}
        for cfg in args.project_configs:
            block, chunk, warps = (int(v) for v in cfg.split("x"))
            impls[f"project/t{block}k{chunk}w{warps}"] = lambda x=trunk, b=block, c=chunk, w=warps: (
                triton_mhc.project(x, fn_d, block_t=b, num_warps=w, block_k=c)
            )
        for name, impl in impls.items():
            try:
                z, ss = impl()
            except Exception as exc:  # noqa: BLE001 - a launch the card cannot take (shared memory) is skipped
                print(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            err = max(
                float((z.double() - z64).norm() / z64.norm()),
                float((ss.double() - ss64).norm() / ss64.norm()),
            )
            us = _median_us(impl, args.repeats)
            records.append({"op": "project", "impl": name, "tokens": t, "streams": m, "hidden": h, "iters": 0,
                            "us_per_call": us, "eager_us_per_call": us, "max_rel_err": err})  # fmt: skip
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 4096, 16384])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=4, help="m, the mHC stream count")
    ap.add_argument("--iters", type=int, default=20, help="Sinkhorn iterations")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument(
        "--project-tokens", type=int, nargs="*", default=[16384], help="the projection sweep's sizes"
    )
    ap.add_argument(
        "--project-configs",
        nargs="+",
        default=["64x64x4", "64x128x4", "64x128x8", "128x128x8", "32x128x4"],
        help="TOKENSxCHUNKxWARPS launches of the projection kernel (tokens per program, columns per chunk)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_mhc_mixes.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    from deepinfer_model.ops import get_ops
    from rich.console import Console
    from rich.table import Table

    cpu, dev = get_ops("cpu"), torch.device("cuda")
    m, h = args.streams, args.hidden
    gen = torch.Generator().manual_seed(0)
    fn = torch.randn((2 + m) * m, m * h, generator=gen) * (m * h) ** -0.5
    base, scale = torch.randn((2 + m) * m, generator=gen) * 0.1, torch.rand(3, generator=gen) + 0.5
    fn_d, base_d, scale_d = fn.to(dev), base.to(dev), scale.to(dev)
    records = []
    for t in args.tokens:
        trunk = (torch.randn(t, m, h, generator=gen) * 2).to(torch.bfloat16)
        check = trunk[: min(t, 64)]
        refs = cpu.hc_mixes(check, fn, base, scale, 1e-6, 1e-6, args.iters)
        trunk_d = trunk.to(dev)
        for name, impl in _implementations().items():

            def call(impl=impl, x=trunk_d):
                return impl(x, fn_d, base_d, scale_d, 1e-6, 1e-6, args.iters)

            outs = impl(trunk_d[: check.shape[0]], fn_d, base_d, scale_d, 1e-6, 1e-6, args.iters)
            err = max(
                float((o.double().cpu() - r.double()).norm() / r.double().norm()) for o, r in zip(outs, refs)
            )
            records.append({"op": "mixes", "impl": name, "tokens": t, "streams": m, "hidden": h, "iters": args.iters,
                            "us_per_call": _median_us(_graphed(call), args.repeats),
                            "eager_us_per_call": _median_us(call, args.repeats), "max_rel_err": err})  # fmt: skip
    records += _project_sweep(args, fn_d, gen)
    for r in records:
        base_us = next(
            x["us_per_call"]
            for x in records
            if x["op"] == r["op"] and x["tokens"] == r["tokens"] and x["impl"] == "torch"
        )
        r["speedup_vs_torch"] = base_us / r["us_per_call"]
    table = Table(
        title=f"hc_mixes on {torch.cuda.get_device_name()} (m={m}, H={h}, {args.iters} Sinkhorn iterations)"
    )
    for c in ("impl", "tokens", "us_per_call", "eager_us_per_call", "speedup_vs_torch", "max_rel_err"):
        table.add_column(c, justify="right")
    for r in records:
        table.add_row(r["impl"], str(r["tokens"]), f"{r['us_per_call']:.1f}", f"{r['eager_us_per_call']:.1f}",
                      f"{r['speedup_vs_torch']:.2f}",
                      f"{r['max_rel_err']:.2e}")  # fmt: skip
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
