"""Where a graphed decode step's time goes on the GPU, per mode (default / batch-invariant) and batch size.

For each (batch, mode): a `PagedRunner` with decode CUDA graphs prefills `--context` tokens per sequence,
then decodes. Reported per step:
  * `execute_ms`: `runner.execute` + the greedy token read-back (what an engine step pays; median);
  * `replay_ms`: one `CUDAGraph.replay()` alone, timed with CUDA events (the device's share; median);
  * `kernels`, `kernel_ms`: kernel launches and summed kernel time of one static step (the graph's body run
    uncaptured under the torch profiler), so `replay_ms - kernel_ms` is the launch gaps inside the graph;
  * the top kernels by time (`--top`), in `<out>.txt`.
The two modes alternate within one process (same model, same inputs); `replay_cost_pct` compares each
replay with the default mode's uncompiled one of the same batch; `--compile inductor` adds the static step
compiled by torch.compile (`runtime/compiled.py`; `first_step_s` then includes the compilation).

    python benchmarks/gpu/profile_decode_step.py [--model PATH] [--numerics exact] [--batches 1 8]
writes benchmarks/out/profile_decode_step.json (flat records) and profile_decode_step.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from deepinfer_cluster import envs
from deepinfer_model.runtime.compiled import BACKENDS

RESULTS = Path(__file__).resolve().parents[1] / "out"
MODES = {"default": "0", "batch_invariant": "1"}


def _median_ms(fn, n: int, cuda: bool) -> float:
    """Median time of `fn()`: CUDA events on a GPU, the host clock on the CPU (the script's dry run)."""
    times = []
    for _ in range(n):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def _kernel_table(prof, steps: int, cuda: bool):
    """(kernel count per step, kernel ms per step, [(name, ms per step, calls per step)] by time); on the
    CPU the ATen ops' self time stands in for kernels."""
    rows = []
    for evt in prof.key_averages():
        if cuda:
            if "CUDA" not in str(getattr(evt, "device_type", "CUDA")):
                continue
            us = getattr(evt, "device_time_total", None)
            us = getattr(evt, "cuda_time_total", 0.0) if us is None else us
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            rows.append((evt.key, us / 1e3 / steps, evt.count / steps))
    rows.sort(key=lambda r: -r[1])
    return sum(r[2] for r in rows), sum(r[1] for r in rows), rows


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The options the step profilers share: which checkpoint, in which dtype, at which batch sizes, in
    which modes (default / batch-invariant)."""
    ap.add_argument("--model", default=None, help="checkpoint directory (default: deepinfer-tiny)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))


def load_profiled_model(args, ap: argparse.ArgumentParser):
    """`args.device` as a torch device (CUDA checked), `args.model_name`, and the loaded model."""
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    from deepinfer.default_model import resolve_model
    from deepinfer_model import load_model

    path = Path(args.model) if args.model else resolve_model(None)[0]
    args.model_name = path.name
    return load_model(path, getattr(torch, args.dtype), device=args.device)


def profile_one(model, b: int, mode: str, args, compile_backend: str | None = None) -> tuple[dict, list]:
    from deepinfer_model import numerics
    from deepinfer_model.runner import StepBatch
    from deepinfer_model.runtime import DecodeGraphSettings, PagedRunner

    os.environ["DEEPINFER_BATCH_INVARIANT"] = MODES[mode]
    cuda = args.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    block = 16
    per_seq = -(-(args.context + args.steps + 2) // block)
    # CPU: the uncaptured static step
    settings = DecodeGraphSettings(b, per_seq * block, capture=cuda, compile=compile_backend)
    runner = PagedRunner(model, num_blocks=b * per_seq, block_size=block, decode_graphs=settings)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(b)]
    rng = np.random.default_rng(0)
    prompt = rng.integers(1000, 90_000, (b, args.context))
    logits = runner.execute(StepBatch.lockstep(tables, 0, prompt))
    tok = torch.argmax(logits, -1).cpu().numpy()[:, None]
    pos = args.context
    walls = []
    for i in range(args.steps):  # the first step captures its graph (and compiles the step, with --compile)
        sync()
        t0 = time.perf_counter()
        logits = runner.execute(StepBatch.lockstep(tables, pos, tok))
        tok = np.array(torch.argmax(logits, -1).tolist())[:, None]
        if i > 0:
            walls.append((time.perf_counter() - t0) * 1e3)
        else:
            first_step_s = time.perf_counter() - t0
            first_logits = logits.float().cpu()  # (same inputs in every configuration of this batch)
        pos += 1
    g = runner.graphs
    assert g.replays == args.steps, f"{g.replays} of {args.steps} decode steps replayed a graph"
    key = (g.select(b), g.select_tier(pos))
    meta = g.meta(*key)

    def body():
        with numerics.resolved():
            g.forward(runner.model, meta, runner.cache)

    replay_ms = _median_ms(g.graphs[key].replay if cuda else body, args.replays, cuda)
    body()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.profile_steps):
        body()
    sync()
    eager_ms = (time.perf_counter() - t0) * 1e3 / args.profile_steps
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(args.profile_steps):
            body()
        sync()
    kernels, kernel_ms, rows = _kernel_table(prof, args.profile_steps, cuda)
    if args.trace:  # the kernels in launch order (chrome://tracing, Perfetto)
        args.trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(args.trace / f"decode_{mode}_{compile_backend or 'none'}_b{b}.json"))
    runner.close()
    rec = {
        "model": args.model_name,
        "numerics": numerics.mode(),
        "mode": mode,
        "compile": compile_backend or "none",
        "batch": b,
        "context": args.context,
        "bucket": key[0],
        "tier": key[1],
        "first_step_s": first_step_s,
        "execute_ms": float(np.median(walls)),
        "replay_ms": replay_ms,
        "uncaptured_static_ms": eager_ms,
        "kernels_per_step": round(kernels, 1),
        "kernel_ms": kernel_ms,
        "launch_gap_ms": replay_ms - kernel_ms,
        # graph breaks Dynamo has met so far in the process (compiled records: the compiled step's split points)
        "graph_breaks": int(sum(torch._dynamo.utils.counters["graph_break"].values())),
        "custom_ops": "1" if envs.DEEPINFER_COMPILE_CUSTOM_OPS else "0",
    }
    FIRST_LOGITS[(b, mode, compile_backend or "none")] = first_logits
    return rec, rows


# the first decode step's logits per (batch, mode, compile): a compiled step is compared with the plain one
FIRST_LOGITS: dict[tuple, torch.Tensor] = {}


def _compare_with_plain(rec: dict) -> None:
    """A compiled record gets how far its first decode step's logits are from the plain step's (same
    inputs): mean |difference|, the plain logits' mean |value| for scale, and the greedy agreement."""
    plain = FIRST_LOGITS.get((rec["batch"], rec["mode"], "none"))
    got = FIRST_LOGITS.get((rec["batch"], rec["mode"], rec["compile"]))
    if rec["compile"] == "none" or plain is None or got is None:
        return
    rec["logits_mean_abs_diff_vs_plain"] = float((got - plain).abs().mean())
    rec["plain_logits_mean_abs"] = float(plain.abs().mean())
    rec["greedy_agree_vs_plain"] = float((got.argmax(-1) == plain.argmax(-1)).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per sequence before decoding")
    ap.add_argument("--steps", type=int, default=12, help="decode steps through runner.execute")
    ap.add_argument("--replays", type=int, default=50, help="graph replays timed with CUDA events")
    ap.add_argument("--profile-steps", type=int, default=3, help="uncaptured static steps under the profiler")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per configuration")
    ap.add_argument(
        "--compile",
        nargs="+",
        default=["none"],
        choices=["none", *BACKENDS],
        help="torch.compile backends of the static step to profile (none: as written; runtime/compiled.py)",
    )
    ap.add_argument("--device", default="cuda", help="cuda[:N]; cpu: a dry run of the script (no graphs)")
    ap.add_argument("--trace", type=Path, default=None, help="write each profiled step's chrome trace here")
    ap.add_argument("--out", type=Path, default=RESULTS / "profile_decode_step.json")
    args = ap.parse_args()
    model = load_profiled_model(args, ap)
    records, text = [], []
    for b in args.batches:
        for mode, backend in [(m, c) for m in args.modes for c in args.compile]:
            if mode == "batch_invariant" and backend != "none":
                continue  # batch-invariant steps never run compiled (runtime/compiled.py)
            rec, rows = profile_one(model, b, mode, args, None if backend == "none" else backend)
            records.append(rec)
            block = [
                f"== {args.model_name} {rec['numerics']} {mode} compile={backend} batch {b}: "
                f"replay {rec['replay_ms']:.2f} ms, "
                f"{rec['kernels_per_step']:.0f} kernels {rec['kernel_ms']:.2f} ms"
            ] + [f"{ms:9.3f} ms {calls:7.1f}x  {name[:140]}" for name, ms, calls in rows[: args.top]]
            print("\n".join(block), flush=True)
            text += block
            _write(args.out, records, text)  # so far: a later configuration may hit the caller's time limit
    # the in-run baseline: the default mode's static step as written, same batch
    for r in records:
        _compare_with_plain(r)
    base = {r["batch"]: r["replay_ms"] for r in records if r["mode"] == "default" and r["compile"] == "none"}
    for r in records:
        if r["batch"] in base:
            r["replay_cost_pct"] = (r["replay_ms"] / base[r["batch"]] - 1) * 100
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode step on the GPU ({args.model_name}, {records[0]['numerics']})")
    cols = [
        "mode",
        "compile",
        "batch",
        "first_step_s",
        "execute_ms",
        "replay_ms",
        "replay_cost_pct",
        "kernels_per_step",
        "kernel_ms",
        "launch_gap_ms",
        "graph_breaks",
        "uncaptured_static_ms",
        "logits_mean_abs_diff_vs_plain",
        "greedy_agree_vs_plain",
    ]
    for c in cols:
        table.add_column(c, justify="right")
    for r in records:
        table.add_row(
            *[f"{r.get(c, 0):.2f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        )
    Console(width=160).print(table)
    _write(args.out, records, text)
    print(f"wrote {args.out}")


def _write(out: Path, records: list, text: list) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1))
    out.with_suffix(".txt").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
