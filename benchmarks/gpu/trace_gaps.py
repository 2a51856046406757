"""Where the device waits for the host in a torch profiler trace: its idle gaps, and the host calls that block.

A prefill chunk's wall time exceeds its summed kernel time (on an H200: 123.6 ms against 113.6 ms of device
time at 16k tokens). This reads the chrome trace `deepinfer bench ... --profile-prefill-chunk N` writes
(`profiles/prefill_chunkN.json`) and lists:
- the device's idle gaps of at least `--min-gap-us` (between kernels, copies and memsets, merged over
  streams), each with the kernel before it, the one after it, the host op that launched the one after it
  (innermost `cpu_op`, and the innermost Python frame of our code when the trace has stacks) and how long after the gap's
  start that launch came;
- the lead-in (from the first host op to the first device activity) and the tail (after the last);
- the blocking runtime calls (`cudaMemcpyAsync`, `cudaStreamSynchronize`, ... of at least `--min-block-us`),
  with the host op and Python frame they ran under: the host syncs that drain the device's queue.

    python benchmarks/gpu/trace_gaps.py TRACE.json [--min-gap-us 20] [--top 25] [--out gaps.json]
prints the tables and writes flat records (`kind`: gap / lead_in / tail / block; `us`, `at_ms`, ...).
"""

from __future__ import annotations

import argparse
import bisect
import json
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
HOST_CATS = {"cpu_op", "user_annotation"}
BLOCKING = ("cudaMemcpy", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass(frozen=True)
class Span:
    name: str
    cat: str
    ts: float  # us
    dur: float  # us
    tid: object
    correlation: int | None

    @property
    def end(self) -> float:
        return self.ts + self.dur


def load_spans(path: Path) -> list[Span]:
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        spans.append(
            Span(e.get("name", "?"), e.get("cat", ""), float(e["ts"]), float(e["dur"]), e.get("tid"),
                 args.get("correlation"))
        )  # fmt: skip
    return spans


class Enclosing:
    """The innermost span of a set (host ops, or Python frames) containing a time on a thread."""

    def __init__(self, spans: list[Span]):
        self.by_tid: dict[object, list[Span]] = {}
        for s in sorted(spans, key=lambda s: (s.ts, -s.dur)):
            self.by_tid.setdefault(s.tid, []).append(s)
        self.starts = {tid: [s.ts for s in ss] for tid, ss in self.by_tid.items()}

    def at(self, tid, t: float) -> Span | None:
        spans = self.by_tid.get(tid, [])
        # spans nest per thread: the innermost one containing t is the last-starting one that contains it
        for i in range(bisect.bisect_right(self.starts.get(tid, []), t) - 1, -1, -1):
            if spans[i].end >= t:
                return spans[i]
        return None


def busy_intervals(device: list[Span]) -> list[tuple[float, float, Span, Span]]:
    """Merged [start, end] of device activity over all streams, with the first and the last-ending span of each."""
    merged = []
    for s in sorted(device, key=lambda s: s.ts):
        if merged and s.ts <= merged[-1][1]:
            lo, hi, first, last = merged[-1]
            merged[-1] = (lo, max(hi, s.end), first, s if s.end >= hi else last)
        else:
            merged.append((s.ts, s.end, s, s))
    return merged


def analyse(
    spans: list[Span], min_gap_us: float = 20.0, min_block_us: float = 50.0, frame_filter: str = "deepinfer"
) -> list[dict]:
    """Flat records (see the module doc). `frame`: the innermost Python frame whose name contains
    `frame_filter` (our code, not torch's internals)."""
    device = [s for s in spans if s.cat in DEVICE_CATS]
    runtime = [s for s in spans if s.cat in RUNTIME_CATS]
    host = [s for s in spans if s.cat in HOST_CATS]
    frames = Enclosing([s for s in spans if s.cat == "python_function" and frame_filter in s.name])
    ops = Enclosing(host)
    launch_of = {s.correlation: s for s in runtime if s.correlation is not None}
    if not device:
        raise ValueError("the trace has no device activity (kernel / gpu_memcpy / gpu_memset events)")
    t0 = min(s.ts for s in spans)  # the trace's extent: host ops, Python frames, runtime calls and the device
    t_end = max(s.end for s in spans)

    def who(tid, t):
        op, frame = ops.at(tid, t), frames.at(tid, t)
        return (op.name if op else "-"), (frame.name if frame else "-")

    records = []
    busy = busy_intervals(device)
    first_dev = busy[0][0]
    records.append(dict(kind="lead_in", us=first_dev - t0, at_ms=0.0, before="-", after=busy[0][2].name))
    for (_, hi, _, last), (lo, _, first, _) in zip(busy, busy[1:]):
        if lo - hi < min_gap_us:
            continue
        rec = dict(kind="gap", us=lo - hi, at_ms=(hi - t0) / 1e3, before=last.name, after=first.name)
        launch = launch_of.get(first.correlation)
        if launch is not None:
            rec["launched_by"], rec["frame"] = who(launch.tid, launch.ts)
            rec["launch_after_gap_start_us"] = launch.ts - hi
        records.append(rec)
    records.append(dict(kind="tail", us=t_end - busy[-1][1], at_ms=(busy[-1][1] - t0) / 1e3,
                        before=busy[-1][3].name, after="-"))  # fmt: skip
    for s in runtime:
        if s.name.startswith(BLOCKING) and s.dur >= min_block_us:
            op, frame = who(s.tid, s.ts)
            records.append(
                dict(
                    kind="block", us=s.dur, at_ms=(s.ts - t0) / 1e3, call=s.name, launched_by=op, frame=frame
                )
            )
    device_us = sum(hi - lo for lo, hi, _, _ in busy)
    records.append(
        dict(kind="total", us=t_end - t0, device_busy_us=device_us, idle_us=t_end - t0 - device_us)
    )
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="chrome trace JSON written by the torch profiler")
    ap.add_argument("--min-gap-us", type=float, default=20.0, help="smallest device idle gap listed")
    ap.add_argument("--min-block-us", type=float, default=50.0, help="shortest blocking runtime call listed")
    ap.add_argument("--top", type=int, default=25, help="rows per table (largest first)")
    ap.add_argument(
        "--frame-filter", default="deepinfer", help="the Python frames named: those containing this"
    )
    ap.add_argument("--out", type=Path, default=None, help="flat JSON records (default: none)")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    records = analyse(load_spans(args.trace), args.min_gap_us, args.min_block_us, args.frame_filter)
    console = Console(width=200)
    total = next(r for r in records if r["kind"] == "total")
    gaps = [r for r in records if r["kind"] in ("gap", "lead_in", "tail")]
    console.print(
        f"{args.trace.name}: {total['us'] / 1e3:.2f} ms, device busy {total['device_busy_us'] / 1e3:.2f} ms, "
        f"idle {total['idle_us'] / 1e3:.2f} ms ({sum(r['us'] for r in gaps if r['kind'] == 'gap') / 1e3:.2f} ms in "
        f"{sum(r['kind'] == 'gap' for r in gaps)} gaps >= {args.min_gap_us:g} us)"
    )
    table = Table(
        "kind",
        "us",
        "at ms",
        "kernel before",
        "kernel after",
        "launched by",
        "frame",
        "launch after gap start us",
    )
    for r in sorted(gaps, key=lambda r: -r["us"])[: args.top]:
        launch = r.get("launch_after_gap_start_us")
        table.add_row(r["kind"], f"{r['us']:.0f}", f"{r['at_ms']:.2f}", r["before"][:40], r["after"][:40],
                      r.get("launched_by", "-"), r.get("frame", "-")[:70], "-" if launch is None else f"{launch:.0f}")  # fmt: skip
    console.print(table)
    blocks = sorted((r for r in records if r["kind"] == "block"), key=lambda r: -r["us"])
    table = Table(
        "blocking call", "us", "at ms", "host op", "frame", title="host calls that wait for the device"
    )
    for r in blocks[: args.top]:
        table.add_row(r["call"], f"{r['us']:.0f}", f"{r['at_ms']:.2f}", r["launched_by"], r["frame"][:90])
    console.print(table)
    if args.out:
        args.out.write_text(json.dumps(records, indent=1))
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
