"""Indexer top-k selection of 16-bit scores: the whole-row sort, unique integer keys + top-k, the select kernel.

`select_topk` picks, per row of index scores [rows, n], the k best valid entries (ties -> lower index),
ascending, -1 padded. Paths: `sort` (`_select_topk_sorted`) sorts every whole row stably; `keys`
(`_select_topk_keys`, the `topk_indices` op's reference) builds one unique int32 key per entry (score bits,
then the reversed index), takes a top-k of those, then sorts only the <= k picks; `op` is `select_topk`
itself (the registry's `topk_indices`: on CUDA the Triton radix select of `triton_select.py`, on the CPU the
keys path), and `op/row...` / `op/bBwW` its register-resident / streamed kernels at other launches
(`--select-configs`).

Defaults are the medium V4.1 model's 16k-token native prefill (rows 16384, n 8192 and 16384, k 512,
BF16, causal prefix masks); on the CPU the rows default to 512 so a run takes seconds.

Times are the median of `--repeats` calls after `--warmup` (CUDA events on the GPU, perf_counter on the
CPU); every result is checked equal to the sort's. Prints a table and writes
benchmarks/out/bench_select_topk.json (one flat record per path and shape; `speedup_vs_sort`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from deepinfer_model.layers.indexer import _select_topk, _select_topk_keys, _select_topk_sorted
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from profile_decode_step import _median_ms  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_select_topk.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# sort: the old whole-row sort; keys: torch.topk of the keys + a sort of the picks (the `topk_indices` op's
# reference); op: `select_topk` itself (the registry's `topk_indices`: on CUDA the Triton radix select);
# op/row[W]: the row-in-registers kernel (W warps); op/bBwW: the streamed kernel, B entries per step, W warps
PATHS: dict[str, Callable] = {"sort": _select_topk_sorted, "keys": _select_topk_keys, "op": _select_topk}


def _inputs(
    rows: int, n: int, dtype: torch.dtype, mask: str, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores like the indexer's (non-negative, ReLU-weighted sums, many 16-bit ties) and the valid mask:
    `prefix` = a causal prefill (row r sees the first (r + 1) * n // rows entries), `full` = all valid."""
    gen = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(rows, n, generator=gen, device=device).mul_(8).to(dtype)
    if mask == "full":
        return scores, torch.ones(rows, n, dtype=torch.bool, device=device)
    lens = (torch.arange(1, rows + 1, device=device) * n) // rows
    return scores, torch.arange(n, device=device)[None, :] < lens[:, None]


def _time_ms(fn: Callable[[], torch.Tensor], device: str, warmup: int, repeats: int) -> float:
    """Median milliseconds per call after `warmup` calls (the GPU benches' timer: CUDA events, else the
    host clock)."""
    for _ in range(warmup):
        fn()
    return _median_ms(fn, repeats, device == "cuda")


def _bench(args: argparse.Namespace, n: int) -> list[dict]:
    dtype = DTYPES[args.dtype]
    scores, valid = _inputs(args.rows, n, dtype, args.mask, args.device)
    want = _select_topk_sorted(scores, valid, args.k)
    records = []
    paths = dict(PATHS)
    if args.device == "cuda":
        from deepinfer_model.backends.nvidia import triton_select

        for cfg in args.select_configs:  # "row" / "rowW": the row in registers; "BxW": streamed in blocks
            if cfg.startswith("row"):
                warps = int(cfg[3:]) if cfg[3:] else None
                paths[f"op/{cfg}"] = lambda s, v, k, w=warps: triton_select.topk_indices(
                    s, v, k, resident=True, num_warps=w
                )
                continue
            block, warps = (int(v) for v in cfg.split("x"))
            paths[f"op/b{block}w{warps}"] = lambda s, v, k, b=block, w=warps: triton_select.topk_indices(
                s, v, k, resident=False, block=b, num_warps=w
            )
    for path, fn in paths.items():
        got = fn(scores, valid, args.k)
        ms = _time_ms(lambda fn=fn: fn(scores, valid, args.k), args.device, args.warmup, args.repeats)
        records.append(
            {
                "device": args.device,
                "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "dtype": args.dtype,
                "mask": args.mask,
                "rows": args.rows,
                "n": n,
                "k": args.k,
                "path": path,
                "ms_per_call": round(ms, 3),
                "equal_to_sort": bool(torch.equal(got, want)),
            }
        )
    base = records[0]["ms_per_call"]
    for r in records:
        r["speedup_vs_sort"] = round(base / r["ms_per_call"], 2)
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--rows", type=int, default=None, help="score rows (queries); default 16384 cuda, 512 cpu")
    p.add_argument("--n", type=int, nargs="+", default=[8192, 16384], help="entries per row")
    p.add_argument("--k", type=int, default=512, help="entries kept per row (index_topk)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="score dtype")
    p.add_argument("--mask", choices=["prefix", "full"], default="prefix", help="valid entries per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    p.add_argument(
        "--select-configs",
        nargs="*",
        default=["row", "row8", "row32", "2048x8", "4096x16"],
        help="launches of the Triton select kernels to time (CUDA): row[WARPS] (the row in registers) or "
        "BLOCKxWARPS (streamed in blocks)",
    )
    p.add_argument("--repeats", type=int, default=10, help="timed calls (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU")
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    if args.rows is None:
        args.rows = 16384 if args.device == "cuda" else 512
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    records = []
    for n in args.n:
        records += _bench(args, n)
    if not all(r["equal_to_sort"] for r in records):
        raise SystemExit("keys path differs from the sort: " + json.dumps(records))

    cols = ["path", "rows", "n", "k", "ms_per_call", "speedup_vs_sort", "equal_to_sort"]
    table = Table(title=f"select_topk on {records[0]['device_name']}, {args.dtype} scores, {args.mask} masks")
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
