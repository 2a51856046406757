"""MoE dispatch / combine bandwidth: DeepEP (`deep_ep.EPBuffer`) against the torch all-to-all backend.

Both backends run in the same invocation on the same routing (``--world`` ranks, one GPU each, NCCL; or gloo
on the CPU for the torch backend only). Per configuration (tokens per rank, hidden, top-k, experts):

* dispatch and combine time (CUDA events, median of ``--iters`` after warm-up, max over ranks);
* logical GB/s per rank = bytes of the distinct (token, destination rank) pairs that leave the rank
  (``hidden`` BF16 values each) / time: the same numerator for both backends, so the ratio is the speed of
  the operation as a user sees it (the torch backend actually sends one row per choice, DeepEP one per rank);
* ``deepep_speedup`` = torch time / DeepEP time.

Routing is uniform random top-k over ``experts`` (no redundancy), distinct experts per token.

    python benchmarks/parallel/bench_ep_comm.py --world 2            # GPU machine, after setup_ep.sh
    python benchmarks/parallel/bench_ep_comm.py --device cpu --world 2 --tokens 64 --hidden 256
Writes benchmarks/out/bench_ep_comm.json (one record per configuration and backend).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from deepinfer_parallel import DeepEPDispatcher, deep_ep_available
from deepinfer_parallel.ep import combine, dispatch
from deepinfer_parallel.launch import run_distributed
from rich.console import Console
from rich.table import Table


class _Timer:
    """Median wall time of a callable: CUDA events on the GPU, perf_counter on the CPU (after a barrier)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, iters: int, warmup: int = 3) -> float:
        import time

        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            dist.barrier()
            if self.cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        local = torch.tensor([statistics.median(times)], dtype=torch.float64)
        if self.cuda:
            local = local.cuda()
        dist.all_reduce(local, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace of a collective
        return float(local.item())


def _routing(tokens: int, experts: int, top_k: int, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
    weights = torch.softmax(torch.rand(tokens, top_k, generator=g), dim=1)
    return ids.to(device), weights.to(device)


def _remote_pairs(ids: torch.Tensor, slots_per_rank: int, rank: int, world: int) -> int:
    """Distinct (token, destination rank) pairs with a destination other than this rank."""
    pairs = torch.zeros(ids.shape[0], world, dtype=torch.bool).scatter_(1, ids.cpu() // slots_per_rank, True)
    pairs[:, rank] = False
    return int(pairs.sum())


def _measure(
    cfg: dict, rank: int, world: int, timer: _Timer, iters: int, use_deepep: bool, device
) -> list[dict]:
    t, h, k, e = cfg["tokens_per_rank"], cfg["hidden"], cfg["top_k"], cfg["experts"]
    s = e // world
    ids, weights = _routing(t, e, k, rank, device)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(rank)).to(device).bfloat16()
    remote = torch.tensor([_remote_pairs(ids, s, rank, world)], dtype=torch.float64, device=device)
    dist.all_reduce(remote)
    bytes_per_rank = float(remote.item()) / world * h * 2
    rows, _slots, handle = dispatch(x, ids, s)
    results = {
        "torch": (
            timer(lambda: dispatch(x, ids, s), iters),
            timer(lambda: combine(rows, handle, weights, t), iters),
        )
    }
    if use_deepep:
        disp = DeepEPDispatcher(None, h, k, e, max_tokens_per_rank=t)
        try:
            drows, _w, _per_slot, dhandle = disp.dispatch(x, ids, weights)
            results["deepep"] = (
                timer(lambda: disp.dispatch(x, ids, weights), iters),
                timer(lambda: disp.combine(drows, dhandle, t), iters),
            )
        finally:
            disp.destroy()
    records = []
    for backend, (dispatch_us, combine_us) in results.items():
        records.append({
            **cfg, "world": world, "backend": backend, "device": device.type,
            "dispatch_us": round(dispatch_us, 2), "combine_us": round(combine_us, 2),
            "dispatch_gb_per_s": round(bytes_per_rank / dispatch_us / 1e3, 2),
            "combine_gb_per_s": round(bytes_per_rank / combine_us / 1e3, 2),
            "remote_mb_per_rank": round(bytes_per_rank / 1e6, 3),
        })  # fmt: skip
        if "deepep" in results:
            records[-1]["deepep_speedup"] = round(sum(results["torch"]) / sum(results["deepep"]), 3)
    return records


def _worker(rank: int, world: int, configs: list[dict], iters: int, out_path: str, use_deepep: bool) -> None:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    timer = _Timer(device)
    records = [r for cfg in configs for r in _measure(cfg, rank, world, timer, iters, use_deepep, device)]
    if rank == 0:
        Path(out_path).write_text(json.dumps(records))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--world", type=int, default=None, help="ranks (default: GPUs on cuda, 2 on cpu)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 4096], help="tokens per rank")
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-deepep", action="store_true", help="torch backend only")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "out" / "bench_ep_comm.json"))
    args = ap.parse_args()
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2:
        raise SystemExit(f"--world must be >= 2 (got {world}); on cuda it needs that many GPUs")
    if args.experts % world:
        raise SystemExit(f"--experts={args.experts} must be a multiple of --world={world}")
    use_deepep = args.device == "cuda" and not args.no_deepep
    if use_deepep and not deep_ep_available():
        raise SystemExit(
            "deep_ep is not importable here (build it: source benchmarks/gpu/setup_ep.sh) or pass --no-deepep"
        )
    configs = [
        {"tokens_per_rank": t, "hidden": h, "top_k": args.top_k, "experts": args.experts}
        for h in args.hidden
        for t in args.tokens
    ]
    with tempfile.TemporaryDirectory() as tmp:
        part = os.path.join(tmp, "records.json")
        run_distributed(
            _worker, world, configs, args.iters, part, use_deepep,
            backend="nccl" if args.device == "cuda" else "gloo",
            start_method="spawn" if args.device == "cuda" else "fork", timeout_s=900,
        )  # fmt: skip
        records = json.loads(Path(part).read_text())
    table = Table(title=f"EP dispatch / combine, {world} ranks ({args.device})")
    for col in (
        "tokens",
        "hidden",
        "backend",
        "dispatch us",
        "combine us",
        "dispatch GB/s",
        "combine GB/s",
        "speedup",
    ):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            str(r["tokens_per_rank"]), str(r["hidden"]), r["backend"], f"{r['dispatch_us']:.1f}",
            f"{r['combine_us']:.1f}", f"{r['dispatch_gb_per_s']:.1f}", f"{r['combine_gb_per_s']:.1f}",
            str(r.get("deepep_speedup", "")),
        )  # fmt: skip
    Console().print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
