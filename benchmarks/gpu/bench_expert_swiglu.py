"""The routed experts' SwiGLU MLP (`expert_swiglu` op) on the GPU: CUTLASS grouped GEMMs vs the Triton kernels.

For each pair count (decode batch x top-k) the same BF16 inputs (the medium V4.1's 16 experts of 1024 x 4096
by default) go through the reference (`torch._grouped_mm` x 3, `layers.experts.grouped_swiglu`) and through
`triton_moe.expert_swiglu` with each column-block configuration of `--configs`. Times are CUDA-graph
replays (the device's time, as in a graphed decode step; median of `--repeats`). The in-run ceiling is the
copy bandwidth measured in the same call: `tbps` = bytes of the experts the call must read (those with at
least one pair) plus activations, over the time, and `fraction_of_copy_bw` against the ceiling. Every output
is checked against the CPU reference (relative error, FP64), so a fast wrong configuration shows in the table.

    python benchmarks/gpu/bench_expert_swiglu.py [--batches 1 8 32 64 128] [--configs 32,64,4 16,32,4 ...]
writes benchmarks/out/bench_expert_swiglu.json (one flat record per implementation and pair count).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mhc_mixes import _graphed, _median_us  # noqa: E402
from profile_decode_step import RESULTS  # noqa: E402


def _config(text: str) -> tuple[int, int, int]:
    parts = [int(v) for v in text.split(",")]
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"a config is gate_up_block_n,down_block_n,num_warps; got {text!r}")
    return tuple(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--inter", type=int, default=1024, help="expert width I")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument(
        "--configs", type=_config, nargs="+", default=[(32, 64, 4), (16, 32, 4), (64, 128, 4), (32, 64, 8)],
        help="Triton column blocks and warps: gate_up_block_n,down_block_n,num_warps",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_expert_swiglu.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    from deepinfer.bench.roofline import measure_ceilings
    from deepinfer_model.backends.nvidia import triton_moe
    from deepinfer_model.layers.experts import grouped_swiglu
    from deepinfer_model.ops import get_ops
    from rich.console import Console
    from rich.table import Table

    dev, bf = torch.device("cuda"), torch.bfloat16
    ceiling = measure_ceilings(dev, bf)["hbm_tbps"]
    gen = torch.Generator().manual_seed(0)
    e, inter, hidden, k = args.experts, args.inter, args.hidden, args.top_k
    w1, w3 = ((torch.randn(e, inter, hidden, generator=gen) * hidden**-0.5).to(bf) for _ in range(2))
    w2 = (torch.randn(e, hidden, inter, generator=gen) * inter**-0.5).to(bf)
    w_dev = [w.to(dev) for w in (w1, w3, w2)]
    cpu = get_ops("cpu")
    impls = {"grouped_mm": grouped_swiglu}
    for gu, down, warps in args.configs:
        cfg = {"gate_up_block_n": gu, "down_block_n": down, "num_warps": warps}
        impls[f"triton {gu}/{down}/{warps}w"] = functools.partial(triton_moe.expert_swiglu, config=cfg)
    records = []
    for batch in args.batches:
        x = torch.randn(batch, hidden, generator=gen).to(bf)
        pairs = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(batch)]).reshape(-1)
        ws = torch.rand(batch * k, generator=gen)
        ref = cpu.expert_swiglu(x, pairs, ws, w1, w3, w2, 7.0, True)
        x_d, pairs_d, ws_d = x.to(dev), pairs.to(dev), ws.to(dev)
        active = int(pairs.unique().numel())
        moved = active * 3 * inter * hidden * 2 + batch * hidden * 2 + batch * k * hidden * 4
        for name, impl in impls.items():
            call = functools.partial(impl, x_d, pairs_d, ws_d, *w_dev, 7.0, True)

            out = call()
            err = float((out.double().cpu() - ref.double()).norm() / ref.double().norm())
            graphed = _graphed(call)
            us = _median_us(graphed, args.repeats)
            records.append({"impl": name, "batch": batch, "pairs": batch * k, "active_experts": active,
                            "experts": e, "inter": inter, "hidden": hidden, "us_per_call": us,
                            "tbps": moved / us / 1e6, "fraction_of_copy_bw": moved / us / 1e6 / ceiling,
                            "copy_bw_tbps": ceiling, "max_rel_err": err})  # fmt: skip
    for r in records:
        base = next(
            x["us_per_call"] for x in records if x["batch"] == r["batch"] and x["impl"] == "grouped_mm"
        )
        r["speedup_vs_grouped_mm"] = base / r["us_per_call"]
    table = Table(title=f"expert_swiglu on {torch.cuda.get_device_name()} ({e} experts {inter}x{hidden}, top-{k}; "
                        f"copy {ceiling:.2f} TB/s)")  # fmt: skip
    cols = ("impl", "batch", "active_experts", "us_per_call", "tbps", "fraction_of_copy_bw", "speedup_vs_grouped_mm",
            "max_rel_err")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="right")
    for r in records:
        table.add_row(*(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
