"""benchmarks/gpu/trace_gaps.py on a hand-built chrome trace whose idle gaps, launches and blocking calls are
known, and on a real CPU profiler trace (no device activity: a clear error)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import trace_gaps  # noqa: E402


def _x(name, cat, ts, dur, tid=1, correlation=None):
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace(tmp_path: Path) -> Path:
    events = [
        _x("deepinfer_model/model.py(10): forward", "python_function", 0, 100),
        _x("torch/_tensor.py(5): item", "python_function", 40, 30),  # (not our code: not named)
        _x("aten::mm", "cpu_op", 0, 10),
        _x("cudaLaunchKernel", "cuda_runtime", 2, 1, correlation=1),
        _x("aten::item", "cpu_op", 40, 30),
        _x("cudaMemcpyAsync", "cuda_runtime", 41, 28, correlation=3),  # waits for the GEMM: a host sync
        _x("aten::add", "cpu_op", 75, 5),
        _x("cudaLaunchKernel", "cuda_runtime", 76, 1, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 77, 1, correlation=4),
        _x("gemm", "kernel", 5, 40, tid=7, correlation=1),
        _x("Memcpy DtoH", "gpu_memcpy", 45, 1, tid=7, correlation=3),
        _x("add_k", "kernel", 78, 12, tid=7, correlation=2),
        _x("other_stream_k", "kernel", 80, 15, tid=8, correlation=4),  # overlaps add_k: one busy span
        {"ph": "i", "name": "marker", "ts": 50},  # (instant events are ignored)
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_gaps_launches_and_blocking_calls_of_a_known_trace(tmp_path):
    records = trace_gaps.analyse(trace_gaps.load_spans(_trace(tmp_path)), min_gap_us=20, min_block_us=20)
    by_kind = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r)
    (gap,) = by_kind["gap"]  # 46 -> 78: the device waits while the host syncs, then launches add_k
    assert gap["us"] == pytest.approx(32) and gap["at_ms"] == pytest.approx(0.046)
    assert (gap["before"], gap["after"]) == ("Memcpy DtoH", "add_k")
    assert (gap["launched_by"], gap["frame"]) == ("aten::add", "deepinfer_model/model.py(10): forward")
    assert gap["launch_after_gap_start_us"] == pytest.approx(30)
    (lead,) = by_kind["lead_in"]
    assert lead["us"] == pytest.approx(5) and lead["after"] == "gemm"
    (tail,) = by_kind["tail"]  # the busy span of two streams ends with the later kernel
    assert tail["us"] == pytest.approx(5) and tail["before"] == "other_stream_k"
    (block,) = by_kind["block"]
    assert (block["call"], block["launched_by"], block["us"]) == ("cudaMemcpyAsync", "aten::item", 28)
    assert block["frame"] == "deepinfer_model/model.py(10): forward"
    (total,) = by_kind["total"]
    assert total["us"] == 100 and total["device_busy_us"] == pytest.approx(41 + 17)
    assert total["idle_us"] == pytest.approx(100 - 58)
    # a higher threshold drops the gap and the blocking call
    records = trace_gaps.analyse(trace_gaps.load_spans(_trace(tmp_path)), min_gap_us=40, min_block_us=40)
    assert not [r for r in records if r["kind"] in ("gap", "block")]


def test_a_trace_without_device_activity_is_refused(tmp_path):
    path = tmp_path / "cpu.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    prof.export_chrome_trace(str(path))
    assert any(s.cat == "cpu_op" for s in trace_gaps.load_spans(path))
    with pytest.raises(ValueError, match="no device activity"):
        trace_gaps.analyse(trace_gaps.load_spans(path))
