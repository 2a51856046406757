"""The indexer's weighted ReLU scores (`index_scores` op, `triton_index.py`) on the GPU: tile configurations.

The medium V4.1's prefill shapes: one call scores T query rows (a 16k-token chunk runs as two row blocks of
8192) x h = 32 index heads of d = 128 against n entries (8192 or 16384: compress ratios 2 and 1). Each
configuration of `triton_index.CONFIGS` ("legacy" is the previous kernel's tile: one 128 x 128 product per
program, no key loop) is timed with the FP32 and BF16 outputs, without bounds (the whole rectangle) and with
the causal bounds (p + 1) // ratio of each row block of the chunk (rows from position 0: a quarter of the
rectangle visible; from position 8192: three quarters). Times are `triton.testing.do_bench` medians (CUDA
events, L2 flushed between calls, after its warm-up). `tflops` counts the visible products only
(2 h d per visible (row, entry) pair), and `fraction_of_mm_ceiling` divides it by an 8192^3 BF16 `torch.mm`
measured in the same run. `speedup_vs_legacy` is against the legacy tile with FP32 output and no bounds (the
previous kernel's call) at the same n. Every output is checked against the torch reference (relative error,
FP64 norms), so a fast wrong configuration shows in the table.

    python benchmarks/gpu/bench_index_scores.py [--entries 8192 16384] [--configs legacy k128_n128 ...]
writes benchmarks/out/bench_index_scores.json (one flat record per configuration, shape, bounds, output).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "out"
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "deepinfer-model" / "src"))


def _median_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _mm_ceiling_tflops(dev: torch.device) -> float:
    """BF16 8192^3 `torch.mm` on random data (the in-run matrix ceiling)."""
    n = 8192
    a, b = (torch.randn(n, n, device=dev).bfloat16() for _ in range(2))
    return 2 * n**3 / _median_ms(lambda: torch.mm(a, b)) / 1e9


def _print_table(title: str, records: list[dict], cols: tuple[str, ...]) -> None:
    cells = [[f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in records]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # (a plain table where rich is not installed)
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        print(title)
        for row in [list(cols), *cells]:
            print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
        return
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="right")
    for row in cells:
        table.add_row(*row)
    Console(width=200).print(table)


def main() -> None:
    from_positions = {"none": None, "causal_rows_0": 0, "causal_rows_8192": 8192}
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192, help="query rows per call (T)")
    ap.add_argument("--entries", type=int, nargs="+", default=[8192, 16384], help="entries per call (n)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk the bounds are taken from")
    ap.add_argument("--bounds", nargs="+", choices=list(from_positions), default=list(from_positions))
    ap.add_argument("--configs", nargs="+", default=None, help="names of triton_index.CONFIGS (default: all)")
    ap.add_argument(
        "--out-dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"]
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_index_scores.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    from deepinfer_model.backends import cpu as reference
    from deepinfer_model.backends.nvidia import triton_index

    configs = args.configs or list(triton_index.CONFIGS)
    unknown = sorted(set(configs) - set(triton_index.CONFIGS))
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {sorted(triton_index.CONFIGS)}")
    dev, t, h, d = torch.device("cuda"), args.rows, args.heads, args.dim
    device = torch.cuda.get_device_name()
    ceiling = _mm_ceiling_tflops(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    records = []
    for n in args.entries:
        ratio = max(1, args.chunk // n)  # the compress ratio that leaves n entries in the chunk
        q = torch.randn(1, t, h, d, device=dev, generator=gen).bfloat16()
        keys = torch.randn(1, n, d, device=dev, generator=gen).bfloat16()
        w = torch.randn(1, t, h, device=dev, generator=gen) * h**-0.5
        for bounds in args.bounds:
            start = from_positions[bounds]
            lim = None
            if start is not None:
                lim = ((torch.arange(t, device=dev) + start + 1) // ratio)[None].to(torch.int32)
            visible = t * n if lim is None else int(lim.clamp(0, n).sum())
            ref = reference.index_scores(q, keys, w, lim).double()
            ref_norm = float(ref.norm())
            for name in configs:
                for out_name in args.out_dtypes:
                    out_dtype = getattr(torch, out_name)

                    call = functools.partial(
                        triton_index.index_scores, q, keys, w, lim, out_dtype, config=name
                    )
                    out = call()
                    torch.cuda.synchronize()
                    err = float((out.double() - ref).norm()) / ref_norm
                    finite = bool(torch.isfinite(out).all())
                    del out
                    ms = _median_ms(call)
                    tflops = 2 * h * d * visible / ms / 1e9
                    tile = {f"cfg_{k}": v for k, v in triton_index.CONFIGS[name].items()}
                    records.append({"device": device, "config": name, "query_rows": t, "entries": n,
                                    "heads": h, "dim": d, "bounds": bounds, "ratio": ratio,
                                    "visible_fraction": visible / (t * n), "out_dtype": out_name,
                                    "ms_per_call": ms, "tflops": tflops,
                                    "fraction_of_mm_ceiling": tflops / ceiling, "mm_ceiling_tflops": ceiling,
                                    "rel_err": err, "finite": finite,
                                    **tile})  # fmt: skip
            del ref
    for r in records:
        base = [x["ms_per_call"] for x in records if x["entries"] == r["entries"] and x["config"] == "legacy"
                and x["bounds"] == "none" and x["out_dtype"] == "float32"]  # fmt: skip
        r["speedup_vs_legacy"] = base[0] / r["ms_per_call"] if base else float("nan")
    cols = ("config", "entries", "bounds", "out_dtype", "ms_per_call", "tflops", "fraction_of_mm_ceiling",
            "speedup_vs_legacy", "rel_err")  # fmt: skip
    title = (f"index_scores on {device} (T={t}, h={h}, d={d}; "
             f"bf16 mm {ceiling:.0f} TFLOP/s)")  # fmt: skip
    _print_table(title, records, cols)
    best = {}
    for r in records:
        key = (r["entries"], r["bounds"], r["out_dtype"])
        if (
            r["finite"]
            and r["rel_err"] < 1e-2
            and (key not in best or r["ms_per_call"] < best[key]["ms_per_call"])
        ):
            best[key] = r
    for (n, bounds, out_name), r in sorted(best.items()):
        print(f"fastest n={n} {bounds} {out_name}: {r['config']} {r['ms_per_call']:.3f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
