"""NVIDIA backend suite: machine ceilings, per-op achieved rate against them, GPU tests, DeepGEMM probe.

Run on the CUDA machine through `benchmarks/gpu/run_gpu_suite.sh` (which unpacks the offline kernel
bundle and builds DeepGEMM in the background). In one call it

1. measures the ceilings: device-to-device copy (TB/s, bytes read + written), bf16 and fp8 GEMM (TFLOP/s);
2. times every registered NVIDIA op (and the plain-torch baseline where there is a kernel) and reports
   achieved TB/s or TFLOP/s and the fraction of the matching ceiling;
3. runs the `gpu` tests (NVIDIA ops against the CPU reference) in parallel pytest shards, and beside
   them `check_model_ops_on_gpu.py` (the tiny V4.1 model with its hot ops on the GPU vs the CPU);
4. probes DeepGEMM in a child process (its first call segfaulted in an earlier session), checks
   `fp8_gemm_nt` against the CPU reference and times it;
5. writes `run_gpu_suite.json` (flat records) and `run_gpu_suite.png` into --out.

Timing: CUDA events, warm-up first, median of the timed calls; inputs are random, never zeros.
"""

# ruff: noqa: B023  (every timed lambda is called inside its own loop iteration)
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RECORDS: list[dict] = []
T_START = time.monotonic()
CEIL_FILE = Path("/tmp/deepinfer_gpu_ceilings.json")  # hands the ceilings to the DeepGEMM child


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:6.1f}s] {msg}", flush=True)


def time_us(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median microseconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def record(**kw) -> dict:
    RECORDS.append(kw)
    return kw


# ---------------------------------------------------------------- ceilings
def measure_ceilings() -> dict[str, float]:
    dev = "cuda"
    ceil: dict[str, float] = {}
    src = torch.randn(512 << 20, device=dev, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters=10)
    ceil["copy_tb_per_s"] = 2 * src.numel() * 2 / us / 1e6
    record(kind="ceiling", op="d2d_copy", shape="1GiB", us_per_call=us, tb_per_s=ceil["copy_tb_per_s"])
    src = dst = None  # free 2 GiB before the GEMMs
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    us = time_us(lambda: a @ b.t(), iters=10)
    ceil["bf16_tflop_per_s"] = 2 * n**3 / us / 1e6
    record(
        kind="ceiling", op="bf16_gemm", shape=f"{n}^3", us_per_call=us, tflop_per_s=ceil["bf16_tflop_per_s"]
    )
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        us = time_us(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), iters=10)
        ceil["fp8_tflop_per_s"] = 2 * n**3 / us / 1e6
        record(
            kind="ceiling",
            op="fp8_gemm_torch_scaled_mm",
            shape=f"{n}^3",
            us_per_call=us,
            tflop_per_s=ceil["fp8_tflop_per_s"],
        )
    except Exception as e:  # noqa: BLE001
        record(kind="ceiling", op="fp8_gemm_torch_scaled_mm", status=f"error: {e!r}"[:300])
    return ceil


# ---------------------------------------------------------------- per-op
def bench_op(name: str, impl: str, shape: str, fn, ceil: dict, bytes_moved: float = 0.0, flops: float = 0.0):
    try:
        us = time_us(fn)
    except Exception as e:  # noqa: BLE001
        log(f"{name}/{impl} {shape}: ERROR {e!r}")
        return record(kind="op", op=name, impl=impl, shape=shape, status=f"error: {e!r}"[:300])
    rec = dict(kind="op", op=name, impl=impl, shape=shape, us_per_call=us, status="ok")
    if bytes_moved:
        rec["tb_per_s"] = bytes_moved / us / 1e6
        rec["frac_of_copy"] = rec["tb_per_s"] / ceil["copy_tb_per_s"]
    if flops:
        rec["tflop_per_s"] = flops / us / 1e6
        rec["frac_of_bf16_gemm"] = rec["tflop_per_s"] / ceil["bf16_tflop_per_s"]
        if "fp8_tflop_per_s" in ceil:
            rec["frac_of_fp8_gemm"] = rec["tflop_per_s"] / ceil["fp8_tflop_per_s"]
    log(
        f"{name}/{impl} {shape}: {us:.1f} us "
        + " ".join(f"{k}={v:.3g}" for k, v in rec.items() if k.startswith(("tb", "tfl", "frac")))
    )
    return record(**rec)


def bench_ops(ceil: dict) -> None:
    from deepinfer_model.backends.nvidia import gemm, torch_cuda
    from deepinfer_model.ops import get_ops, store_fp8_tokens
    from deepinfer_model.quant import quant_fp8_block

    ops = get_ops("nvidia")
    impl = {name: f"{src}:{getattr(ops[name], '__name__', '?')}" for name, src in ops.sources.items()}
    record(kind="registry", backend=ops.backend, **{f"src_{k}": v for k, v in ops.sources.items()})
    dev = "cuda"
    bf = torch.bfloat16

    for t, h in [(4096, 7168), (32768, 7168), (65536, 512)]:
        x, w = torch.randn(t, h, device=dev, dtype=bf), torch.randn(h, device=dev)
        nbytes = 2 * t * h * 2 + h * 4
        bench_op(
            "rms_norm",
            impl["rms_norm"],
            f"T={t},H={h}",
            lambda: ops.rms_norm(x, w, 1e-6),
            ceil,
            nbytes,
        )
        bench_op(
            "rms_norm", "torch_eager", f"T={t},H={h}", lambda: torch_cuda.rms_norm(x, w, 1e-6), ceil, nbytes
        )

    for t in (256, 4096):
        q = torch.randn(t, 64, 512, device=dev, dtype=bf)
        ang = torch.rand(t, 32, device=dev) * 100
        c, s = ang.cos(), ang.sin()
        bench_op(
            "apply_rope",
            impl["apply_rope"],
            f"T={t},nh=64,D=512,r=64",
            lambda: ops.apply_rope(q, c, s),
            ceil,
            2 * q.numel() * 2,
        )
        bench_op(
            "apply_rope",
            "torch_eager",
            f"T={t},nh=64,D=512,r=64",
            lambda: torch_cuda.apply_rope(q, c, s),
            ceil,
            2 * q.numel() * 2,
        )

    for t in (64, 4096):
        m, h = 4, 7168
        trunk = torch.randn(t, m, h, device=dev, dtype=bf)
        fn = torch.randn((2 + m) * m, m * h, device=dev) * (m * h) ** -0.5
        base, sc = torch.randn((2 + m) * m, device=dev) * 0.1, torch.rand(3, device=dev) + 0.5
        shape = f"T={t},m=4,H=7168"
        bench_op(
            "hc_mixes",
            impl["hc_mixes"],
            shape,
            lambda: ops.hc_mixes(trunk, fn, base, sc, 1e-6, 1e-6, 20),
            ceil,
            trunk.numel() * 2 + fn.numel() * 4,
            2 * t * fn.shape[0] * fn.shape[1],
        )
        bench_op(
            "hc_mixes",
            "torch_eager",
            shape,
            lambda: torch_cuda.hc_mixes(trunk, fn, base, sc, 1e-6, 1e-6, 20),
            ceil,
            trunk.numel() * 2 + fn.numel() * 4,
            2 * t * fn.shape[0] * fn.shape[1],
        )
        pre, post, comb = ops.hc_mixes(trunk, fn, base, sc, 1e-6, 1e-6, 20)
        y = torch.randn(t, h, device=dev, dtype=bf)
        bench_op(
            "hc_read",
            impl["hc_read"],
            shape,
            lambda: ops.hc_read(trunk, pre),
            ceil,
            trunk.numel() * 2 + t * h * 2,
        )
        bench_op(
            "hc_read",
            "torch_eager",
            shape,
            lambda: torch_cuda.hc_read(trunk, pre),
            ceil,
            trunk.numel() * 2 + t * h * 2,
        )
        bench_op(
            "hc_write",
            impl["hc_write"],
            shape,
            lambda: ops.hc_write(y, trunk, post, comb),
            ceil,
            2 * trunk.numel() * 2 + t * h * 2,
        )
        bench_op(
            "hc_write",
            "torch_eager",
            shape,
            lambda: torch_cuda.hc_write(y, trunk, post, comb),
            ceil,
            2 * trunk.numel() * 2 + t * h * 2,
        )

    t = 4096
    lat = torch.randn(t, 512, device=dev, dtype=bf)
    cache = torch.zeros(256, 64, 1, 528, device=dev, dtype=torch.uint8)
    slots = torch.randperm(256 * 64, device=dev)[:t]
    bench_op(
        "kv_store_fp8",
        impl["kv_store_fp8"],
        f"T={t}",
        lambda: store_fp8_tokens(lat, cache, slots),
        ceil,
        t * 512 * 2 + t * 528,
    )

    blocks, page = 2048, 64  # 131072 cached tokens, 69 MB of cache (above the 60 MB L2)
    cache = torch.empty(blocks, page, 1, 528, device=dev, dtype=torch.uint8)
    for i in range(0, blocks * page, 16384):
        store_fp8_tokens(torch.randn(16384, 512, device=dev), cache, torch.arange(i, i + 16384, device=dev))
    for b, h, topk in [(1, 64, 512), (8, 64, 512), (64, 64, 512), (128, 128, 512), (64, 64, 2048)]:
        idx = torch.randint(0, blocks * page, (b, topk), device=dev, dtype=torch.int32)
        q = torch.randn(b, h, 512, device=dev, dtype=bf)
        sinks = torch.randn(h, device=dev)
        nbytes = b * topk * 528 + 2 * q.numel() * 2 + idx.numel() * 4
        bench_op(
            "sparse_decode_attention",
            impl["sparse_decode_attention"],
            f"B={b},h={h},topk={topk}",
            lambda: ops.sparse_decode_attention(q, cache, idx, sinks, 512**-0.5),
            ceil,
            nbytes,
            4 * b * h * topk * 512,
        )

    from deepinfer_model.backends.nvidia import TILELANG_FALLBACKS

    record(kind="tilelang_fallbacks", fallbacks=json.dumps(TILELANG_FALLBACKS))
    for m, n, k in GEMM_SHAPES:
        x = torch.randn(m, k, device=dev, dtype=bf)
        w, s = quant_fp8_block(torch.randn(n, k) * k**-0.5, (128, 128))
        w, s = w.to(dev), s.float().to(dev)
        bench_op(
            "fp8_block_linear",
            "dequant_bf16",
            f"M={m},N={n},K={k}",
            lambda: gemm.fp8_block_linear_dequant(x, w, s),
            ceil,
            n * k + m * k * 2 + m * n * 2,
            2 * m * n * k,
        )
        xq, xs = gemm.quant_act_fp8(x)
        bench_op(
            "fp8_act_quant",
            "torch",
            f"M={m},K={k}",
            lambda: gemm.quant_act_fp8(x),
            ceil,
            m * k * 3 + m * k // 32,
        )
        bench_op(
            "fp8_act_quant",
            "tile_kernels",
            f"M={m},K={k}",
            lambda: gemm.quant_act_fp8_tile_kernels(x),
            ceil,
            m * k * 3 + m * k // 32,
        )

    from deepinfer_model.backends.nvidia import moe

    for t, e, k, h, i in GROUPED_EXPERT_SHAPES[:2]:  # the dequantised BF16 fallback (no DeepGEMM)
        w13, s13, w2, s2 = _random_fp8_experts(e, h, i)
        x = torch.randn(t, h, device=dev, dtype=bf)
        w, ids = _grouped_expert_routing(t, e, k)
        flops, nbytes = _grouped_expert_flops_bytes(t, e, k, h, i)
        bench_op(
            "grouped_expert_mlp",
            "dequant_bf16",
            f"T={t},E={e},k={k},H={h},I={i}",
            lambda: moe.grouped_expert_mlp_dequant(x, w, ids, w13, s13, w2, s2, 10.0, True),
            ceil,
            nbytes,
            flops,
        )
        w13 = w2 = None


GEMM_SHAPES = [(64, 7168, 4096), (4096, 7168, 4096), (4096, 2048, 7168), (16384, 7168, 2048)]


# ---------------------------------------------------------------- DeepGEMM (child process)
def deep_gemm_probe(out: Path, ceil: dict) -> None:
    """Runs in a child process: a segfault here must not take the suite down."""
    import faulthandler

    faulthandler.enable()
    t0 = time.monotonic()
    import deep_gemm

    print(
        f"deep_gemm {getattr(deep_gemm, '__version__', '?')} imported in {time.monotonic() - t0:.1f}s "
        f"CUDA_HOME={os.environ.get('CUDA_HOME')} DG_JIT_CACHE_DIR={os.environ.get('DG_JIT_CACHE_DIR')}",
        flush=True,
    )
    from deepinfer_model.backends.nvidia import gemm
    from deepinfer_model.ops import get_ops
    from deepinfer_model.quant import quant_fp8_block

    cpu = get_ops("cpu")
    recs = []
    for m, n, k in [(128, 256, 512)] + GEMM_SHAPES + [(16, 1536, 512)]:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        w, s = quant_fp8_block(torch.randn(n, k) * k**-0.5, (128, 128))
        s = s.float()
        print(f"fp8_gemm_nt M={m} N={n} K={k} ...", flush=True)
        xd, wd, sd = x.cuda(), w.cuda(), s.cuda()
        out_ = gemm.fp8_block_linear_deep_gemm(xd, wd, sd)
        torch.cuda.synchronize()
        rec = dict(
            kind="op", op="fp8_block_linear", impl="deep_gemm", shape=f"M={m},N={n},K={k}", status="ok"
        )
        if m * n * k <= 4096 * 7168 * 4096:
            ref = cpu.fp8_block_linear(x, w, s).double()
            o = out_.double().cpu()
            rec["rel_err_vs_cpu"] = float((o - ref).norm() / ref.norm())
            rec["finite"] = bool(torch.isfinite(o).all())
        if (m, n, k) in GEMM_SHAPES:
            us = time_us(lambda: gemm.fp8_block_linear_deep_gemm(xd, wd, sd))
            rec.update(
                us_per_call=us,
                tflop_per_s=2 * m * n * k / us / 1e6,
                tb_per_s=(n * k + m * k * 2 + m * n * 2) / us / 1e6,
            )
            rec["frac_of_bf16_gemm"] = rec["tflop_per_s"] / ceil["bf16_tflop_per_s"]
            if "fp8_tflop_per_s" in ceil:
                rec["frac_of_fp8_gemm"] = rec["tflop_per_s"] / ceil["fp8_tflop_per_s"]
        print(rec, flush=True)
        recs.append(rec)
        (out / "deep_gemm_probe.json").write_text(json.dumps(recs, indent=1))
    recs.append(_grouped_probe(deep_gemm, gemm, cpu, ceil))
    (out / "deep_gemm_probe.json").write_text(json.dumps(recs, indent=1))
    for rec in _grouped_expert_probe(cpu, ceil):
        recs.append(rec)
        (out / "deep_gemm_probe.json").write_text(json.dumps(recs, indent=1))


def _grouped_probe(deep_gemm, gemm, cpu, ceil: dict) -> dict:
    """M-grouped contiguous FP8 GEMM (the MoE experts): rows of group g use expert g's weight; `m_indices`
    gives each row's group (segments aligned to DeepGEMM's M alignment)."""
    from deepinfer_model.quant import quant_fp8_block

    groups, rows, n, k = 8, 256, 2048, 7168
    rec = dict(
        kind="op",
        op="m_grouped_fp8_gemm",
        impl="deep_gemm",
        shape=f"G={groups},M={rows}x{groups},N={n},K={k}",
    )
    try:
        align = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
        assert rows % align == 0, f"rows {rows} not a multiple of the alignment {align}"
        x = torch.randn(groups * rows, k, dtype=torch.bfloat16)
        ws, ss = zip(*(quant_fp8_block(torch.randn(n, k) * k**-0.5, (128, 128)) for _ in range(groups)))
        w, s = torch.stack(ws).cuda(), torch.stack([t.float() for t in ss]).cuda()
        m_idx = torch.arange(groups, dtype=torch.int32).repeat_interleave(rows).cuda()
        xq, xs = gemm.quant_act_fp8(x.cuda())
        d = torch.empty(groups * rows, n, dtype=torch.bfloat16, device="cuda")

        def run():
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (w, s), d, m_idx)

        run()
        torch.cuda.synchronize()
        errs = []
        for g in (0, groups - 1):
            ref = cpu.fp8_block_linear(x[g * rows : (g + 1) * rows], ws[g], ss[g].float()).double()
            got = d[g * rows : (g + 1) * rows].double().cpu()
            errs.append(float((got - ref).norm() / ref.norm()))
        us = time_us(run)
        flops = 2 * groups * rows * n * k
        rec.update(
            status="ok", rel_err_vs_cpu=max(errs), finite=bool(torch.isfinite(d).all()), us_per_call=us
        )
        rec.update(
            tflop_per_s=flops / us / 1e6, tb_per_s=(groups * n * k + groups * rows * (k + 2 * n)) / us / 1e6
        )
        rec["frac_of_bf16_gemm"] = rec["tflop_per_s"] / ceil["bf16_tflop_per_s"]
        if "fp8_tflop_per_s" in ceil:
            rec["frac_of_fp8_gemm"] = rec["tflop_per_s"] / ceil["fp8_tflop_per_s"]
    except Exception as e:  # noqa: BLE001
        rec["status"] = f"error: {e!r}"[:400]
    print(rec, flush=True)
    return rec


# ---------------------------------------------------------------- grouped expert MLP (routed MoE)
# (tokens, experts, top-k, hidden, intermediate): decode- and prefill-sized batches of one EP rank's
# experts at V4.1-like widths (DeepGEMM's test defaults H=7168, I=3072; spec v41-model 12)
GROUPED_EXPERT_SHAPES = [(128, 32, 6, 7168, 3072), (4096, 32, 6, 7168, 3072), (16384, 32, 6, 7168, 3072)]


def _random_fp8_experts(e: int, h: int, i: int, dev: str = "cuda"):
    """Random FP8 expert weights for timing (values do not change the GEMM time; never zeros), made per
    expert so the BF16 temporaries stay small."""
    w13 = torch.empty(e, 2 * i, h, dtype=torch.float8_e4m3fn, device=dev)
    w2 = torch.empty(e, h, i, dtype=torch.float8_e4m3fn, device=dev)
    for j in range(e):
        w13[j] = (torch.randn(2 * i, h, device=dev, dtype=torch.bfloat16) * 64).to(torch.float8_e4m3fn)
        w2[j] = (torch.randn(h, i, device=dev, dtype=torch.bfloat16) * 64).to(torch.float8_e4m3fn)
    s13 = torch.full((e, 2 * i // 128, h // 128), 2.0**-6 * h**-0.5, device=dev)
    s2 = torch.full((e, h // 128, i // 128), 2.0**-6 * i**-0.5, device=dev)
    return w13, s13, w2, s2


def _grouped_expert_flops_bytes(t: int, e: int, k: int, h: int, i: int) -> tuple[float, float]:
    """FLOPs of the two grouped GEMMs (2*T*k*(2I*H + H*I)) and the bytes they must move: the weights of
    the experts hit (all of them here) plus the activations in and out."""
    flops = 2.0 * t * k * (2 * i * h + h * i)
    nbytes = e * 3 * i * h + t * k * (h + 2 * 2 * i + i + 2 * h) + t * h * (2 + 4)
    return flops, nbytes


def _grouped_expert_routing(t: int, e: int, k: int, dev: str = "cuda"):
    w, ids = torch.rand(t, e, device=dev).topk(k, dim=1)
    return (w / w.sum(1, keepdim=True)).float(), ids


def _grouped_expert_probe(cpu, ceil: dict) -> list[dict]:
    """`grouped_expert_mlp` through DeepGEMM (child process): checked against the CPU reference on MXFP4
    experts converted to the SM90 FP8 layout, then timed at GROUPED_EXPERT_SHAPES (TFLOP/s vs the fp8
    ceiling; the whole op: routing plan with its host sync, activation quantisation, two grouped GEMMs,
    SwiGLU, combine)."""
    from deepinfer_model.backends.nvidia import moe
    from deepinfer_model.quant import quant_mxfp4
    from deepinfer_model.quant_sm90 import fp8_experts_from_mxfp4

    recs = []
    t, e, k, h, i = 300, 32, 6, 1024, 384
    rec = dict(
        kind="op", op="grouped_expert_mlp", impl="deep_gemm", shape=f"check T={t},E={e},k={k},H={h},I={i}"
    )
    try:

        def stack(n, kk):
            parts = [quant_mxfp4(torch.randn(n, kk) * kk**-0.5) for _ in range(e)]
            return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])

        ex = fp8_experts_from_mxfp4(stack(i, h), stack(i, h), stack(h, i))
        x = (torch.randn(t, h) * 3).to(torch.bfloat16)
        w, ids = _grouped_expert_routing(t, e, k, "cpu")
        ref = cpu.grouped_expert_mlp(x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2, 4.0, True).double()
        args = [a.cuda() for a in (x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2)]
        got = moe.grouped_expert_mlp_deep_gemm(*args, 4.0, True).double().cpu()
        rec.update(
            status="ok",
            rel_err_vs_cpu=float((got - ref).norm() / ref.norm()),
            finite=bool(torch.isfinite(got).all()),
            conversion_inexact_blocks=ex.stats.inexact_blocks,
        )
    except Exception as exc:  # noqa: BLE001
        rec["status"] = f"error: {exc!r}"[:400]
    print(rec, flush=True)
    recs.append(rec)
    for t, e, k, h, i in GROUPED_EXPERT_SHAPES:
        rec = dict(
            kind="op", op="grouped_expert_mlp", impl="deep_gemm", shape=f"T={t},E={e},k={k},H={h},I={i}"
        )
        try:
            w13, s13, w2, s2 = _random_fp8_experts(e, h, i)
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            w, ids = _grouped_expert_routing(t, e, k)
            out = moe.grouped_expert_mlp_deep_gemm(x, w, ids, w13, s13, w2, s2, 10.0, True)
            torch.cuda.synchronize()
            rec["finite"] = bool(torch.isfinite(out).all())
            us = time_us(lambda: moe.grouped_expert_mlp_deep_gemm(x, w, ids, w13, s13, w2, s2, 10.0, True))
            flops, nbytes = _grouped_expert_flops_bytes(t, e, k, h, i)
            rec.update(status="ok", us_per_call=us, tflop_per_s=flops / us / 1e6, tb_per_s=nbytes / us / 1e6)
            rec["frac_of_bf16_gemm"] = rec["tflop_per_s"] / ceil["bf16_tflop_per_s"]
            if "fp8_tflop_per_s" in ceil:
                rec["frac_of_fp8_gemm"] = rec["tflop_per_s"] / ceil["fp8_tflop_per_s"]
            if "copy_tb_per_s" in ceil:
                rec["frac_of_copy"] = rec["tb_per_s"] / ceil["copy_tb_per_s"]
            w13 = w2 = None
        except Exception as exc:  # noqa: BLE001
            rec["status"] = f"error: {exc!r}"[:400]
        print(rec, flush=True)
        recs.append(rec)
    return recs


def wait_for_build(build_pid: int, deadline: float) -> None:
    t0 = time.monotonic()
    log("waiting for the DeepGEMM build ...")
    while build_pid and time.monotonic() < deadline - 90:
        try:
            os.kill(build_pid, 0)
        except OSError:
            break
        time.sleep(2)
    record(kind="deep_gemm_build_wait", waited_s=round(time.monotonic() - t0, 1))


def _v4_layout_candidates(lat: torch.Tensor, page: int) -> dict[str, torch.Tensor]:
    """Candidate byte layouts of FlashMLA's 584-B "V4" token (hypotheses, to be told apart on the GPU).

    Content assumed in every candidate: 448 no-RoPE values as E4M3 with 7 UE8M0 scales (one per 64),
    64 RoPE values as BF16, one pad byte: 448 + 128 + 7 + 1 = 584. Returns {name: uint8 [blocks, page, 1, 584]}
    and, under "ref", the FP32 values every candidate encodes.
    """
    n = lat.shape[0]
    g = lat[:, :448].float().view(n, 7, 64)
    mant, exp = torch.frexp(g.abs().amax(-1).clamp(min=1e-4) / 448.0)
    e = torch.where(mant == 0.5, exp - 1, exp)
    scale = torch.ldexp(torch.ones_like(g[..., 0]), e)
    q = (g / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    rope = lat[:, 448:].to(torch.bfloat16)
    sc = torch.cat(((e + 127).to(torch.uint8), torch.zeros(n, 1, dtype=torch.uint8, device=lat.device)), 1)
    data = torch.cat((q.view(n, 448).view(torch.uint8), rope.view(torch.uint8).view(n, 128)), 1)  # [n, 576]
    blocks = n // page
    paged = torch.cat((data.view(blocks, page * 576), sc.view(blocks, page * 8)), 1)
    return {
        "ref": torch.cat(((q.float() * scale.unsqueeze(-1)).view(n, 448), rope.float()), 1),
        "token[fp8|bf16|scales]": torch.cat((data, sc), 1).view(blocks, page, 1, 584),
        "token[fp8|scales|bf16]": torch.cat((data[:, :448], sc, data[:, 448:]), 1).view(blocks, page, 1, 584),
        "page[all data|all scales]": paged.view(blocks, page, 1, 584),
        "token[bf16|fp8|scales]": torch.cat((data[:, 448:], data[:, :448], sc), 1).view(blocks, page, 1, 584),
    }


def _v32_no_rope_probe(call, blocks: int, page: int, q, idx, sinks) -> None:
    """FlashMLA's SM90 kernels also name a 528-B "V3.2-no-RoPE" format (kv_format="V32_NO_ROPE").
    Hypothesis: 512 E4M3 values then 4 FP32 scales, one per 128 channels (the V3.2 token minus its BF16
    RoPE part). With power-of-two scales that is V4.1's Q8 rule at 128-channel groups, so if it matches,
    Hopper can run FlashMLA on an SWA cache stored this way. Tried with the sink and without it (the sink
    can then be folded in afterwards from the returned LSE)."""
    from deepinfer_model.backends.nvidia.torch_cuda import sink_decode_from_keys

    n = blocks * page
    lat = torch.randn(n, 512, device="cuda")
    g = lat.view(n, 4, 128)
    mant, exp = torch.frexp(g.abs().amax(-1).clamp(min=1e-4) / 448.0)
    scale = torch.ldexp(torch.ones_like(mant), torch.where(mant == 0.5, exp - 1, exp))  # [n, 4]
    qv = (g / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache = torch.cat((qv.view(n, 512).view(torch.uint8), scale.contiguous().view(torch.uint8)), 1)
    cache = cache.view(blocks, page, 1, 528)
    keys = (qv.float() * scale.unsqueeze(-1)).view(n, 512)[idx.long()]
    for with_sink in (True, False):
        ref = sink_decode_from_keys(
            q, keys, idx, sinks if with_sink else torch.full_like(sinks, -1e30), 512**-0.5
        )
        try:
            out = call(cache, q, idx, sinks if with_sink else None, "V32_NO_ROPE").double()
            rel = float((out - ref.double()).norm() / ref.double().norm())
            status = f"rel_err={rel:.3g} finite={bool(torch.isfinite(out).all())}"
        except Exception as e:  # noqa: BLE001
            status = f"error: {e}"[:400]
        log(f"flash_mla V32_NO_ROPE (528 B, fp8 + 4 fp32 scales) sink={with_sink}: {status}")
        record(kind="flash_mla_v32_no_rope_probe", with_sink=with_sink, status=status)


def flash_mla_format_probe() -> None:
    """FlashMLA's SM90 sparse decode: which cache sizes it accepts (its error names them) and which
    layout hypothesis of the 584-B V4 token reproduces the reference attention."""
    from deepinfer_model.backends.nvidia.torch_cuda import sink_decode_from_keys
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    def call(cache, q, idx, sinks, fmt):
        meta, _ = get_mla_metadata()
        out, _ = flash_mla_with_kvcache(
            q.unsqueeze(1),
            cache,
            None,
            None,
            head_dim_v=512,
            tile_scheduler_metadata=meta,
            softmax_scale=512**-0.5,
            is_fp8_kvcache=True,
            indices=idx.unsqueeze(1),
            attn_sink=sinks,
            use_legacy=True,
            kv_format=fmt,
        )
        return out.squeeze(1)

    blocks, page, b, h, topk = 16, 64, 4, 64, 128
    q = torch.randn(b, h, 512, dtype=torch.bfloat16, device="cuda")
    idx = torch.stack([torch.randperm(blocks * page, device="cuda")[:topk] for _ in range(b)]).to(torch.int32)
    sinks = torch.randn(h, device="cuda")
    for bpt, fmt in [(528, "V41"), (600, "V4")]:
        try:
            call(
                torch.randint(0, 0x38, (blocks, page, 1, bpt), dtype=torch.uint8, device="cuda"),
                q,
                idx,
                sinks,
                fmt,
            )
            torch.cuda.synchronize()
            status = "accepted"
        except Exception as e:  # noqa: BLE001
            status = f"rejected: {e}"[:600]
        log(f"flash_mla sparse decode bytes_per_token={bpt} kv_format={fmt}: {status}")
        record(kind="flash_mla_format_probe", bytes_per_token=bpt, kv_format=str(fmt), status=status)
    _v32_no_rope_probe(call, blocks, page, q, idx, sinks)
    cands = _v4_layout_candidates(torch.randn(blocks * page, 512, device="cuda"), page)
    keys = cands.pop("ref")[idx.long()]  # [b, topk, 512]
    ref = sink_decode_from_keys(q, keys, idx, sinks, 512**-0.5).double()
    for name, cache in cands.items():
        try:
            out = call(cache, q, idx, sinks, "V4").double()
            rel = float((out - ref).norm() / ref.norm())
            status = f"rel_err={rel:.3g} finite={bool(torch.isfinite(out).all())}"
        except Exception as e:  # noqa: BLE001
            status = f"error: {e}"[:300]
        log(f"flash_mla V4 layout hypothesis {name}: {status}")
        record(kind="flash_mla_v4_layout_probe", layout=name, status=status)


def run_deep_gemm(out: Path, ceil: dict, deadline: float) -> bool:
    env = dict(
        os.environ,
        DG_JIT_CACHE_DIR="/tmp/dg-jit-cache",
        DG_JIT_PRINT_COMPILER_COMMAND="1",
        PYTHONFAULTHANDLER="1",
        LC_ALL="C",  # the earlier crashes were in locale-dependent libstdc++ code (see README)
    )
    env.setdefault("HOME", "/root")
    CEIL_FILE.write_text(json.dumps(ceil))
    left = max(30, int(deadline - time.monotonic()) - 20)
    log(f"DeepGEMM probe (timeout {left}s)")
    try:
        p = subprocess.run(
            [sys.executable, "-X", "faulthandler", __file__, "--deep-gemm-probe", "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=left,
        )
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = (
            "timeout",
            (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"),
        )
    (out / "deep_gemm_probe.log").write_text(text)
    print(text[-3000:], flush=True)
    probe = out / "deep_gemm_probe.json"
    recs = json.loads(probe.read_text()) if probe.exists() else []
    RECORDS.extend(recs)
    ok = rc == 0 and all(r.get("rel_err_vs_cpu", 0) < 1e-2 and r.get("finite", True) for r in recs)
    record(kind="deep_gemm_probe", returncode=str(rc), ok=ok, n_shapes=len(recs))
    return ok


# ---------------------------------------------------------------- tests
NV_TESTS = "packages/deepinfer-model/tests/test_ops_nvidia.py"
# pytest shards run side by side: TileLang compiles (nvcc, one core each) dominate the test time
TEST_SHARDS = {
    "norm": [NV_TESTS, "-k", "rms_norm or no_tilelang"],
    "rope": [NV_TESTS, "-k", "rope or no_tilelang"],
    "mhc": [NV_TESTS, "-k", "hc_ or mhc or no_tilelang"],
    "gemm_attn_kv": [NV_TESTS, "-k", "fp8 or sparse or kv_store or no_tilelang"],
    "registry": ["packages/deepinfer-model/tests/test_ops_registry.py"],
    "grouped_moe": ["packages/deepinfer-model/tests/test_grouped_moe_gpu.py"],
}


def run_tests(out: Path, deadline: float) -> None:
    """The gpu test shards and the tiny-model check, all at once; each writes its own log."""
    left = max(60, int(deadline - time.monotonic()) - 150)
    log(f"pytest shards + model check (timeout {left}s)")
    env = dict(os.environ, DEEPINFER_DEEP_GEMM="0", OMP_NUM_THREADS="2")  # DeepGEMM: own process (probe)
    procs = {}
    for name, argv in TEST_SHARDS.items():
        cmd = [sys.executable, "-m", "pytest", *argv, "-q", "-rfE", "-p", "no:cacheprovider"]
        cmd.append(f"--junitxml={out / f'gpu_tests_{name}.xml'}")
        procs[name] = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    check = [sys.executable, str(Path(__file__).with_name("check_model_ops_on_gpu.py")), "--out", str(out)]
    procs["model_check"] = subprocess.Popen(
        check, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    end = time.monotonic() + left
    for name, p in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1, end - time.monotonic()))
            rc = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            text, rc = p.communicate()[0], "timeout"
        (out / f"gpu_tests_{name}.log").write_text(text)
        print(f"--- {name} (rc={rc})\n{text[-2500:]}", flush=True)
        summary = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
        record(kind="tests", shard=name, returncode=str(rc), summary=summary[-1] if summary else text[-300:])
    model = out / "check_model_ops_on_gpu.json"
    if model.exists():
        for r in json.loads(model.read_text()):
            record(kind="model_check", **r)


# ---------------------------------------------------------------- report
def write_report(out: Path) -> None:
    (out / "run_gpu_suite.json").write_text(json.dumps(RECORDS, indent=1))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="NVIDIA ops vs measured ceilings")
        for col in ("op", "impl", "shape", "us", "TB/s", "TFLOP/s", "frac"):
            table.add_column(col)
        for r in RECORDS:
            if r.get("kind") not in ("op", "ceiling"):
                continue
            frac = (
                r.get("frac_of_copy")
                if "frac_of_copy" in r and "tflop_per_s" not in r
                else r.get("frac_of_bf16_gemm")
            )
            if r.get("op") == "sparse_decode_attention":
                frac = r.get("frac_of_copy")
            table.add_row(
                r.get("op", ""),
                r.get("impl", r.get("kind", "")),
                r.get("shape", ""),
                f"{r['us_per_call']:.1f}" if "us_per_call" in r else r.get("status", "")[:40],
                f"{r['tb_per_s']:.3f}" if "tb_per_s" in r else "",
                f"{r['tflop_per_s']:.1f}" if "tflop_per_s" in r else "",
                f"{frac:.2f}" if frac is not None else "",
            )
        Console(width=160).print(table)
    except Exception as e:  # noqa: BLE001
        print("table failed:", e)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [
            r for r in RECORDS if r.get("kind") == "op" and r.get("status") == "ok" and "us_per_call" in r
        ]
        labels, fracs, colors = [], [], []
        for r in rows:
            mem = r["op"] not in ("fp8_block_linear", "grouped_expert_mlp") or r["shape"].startswith("M=64,")
            gemm_frac = r.get("frac_of_fp8_gemm") if r["impl"] == "deep_gemm" else r.get("frac_of_bf16_gemm")
            f = r.get("frac_of_copy") if mem else gemm_frac
            if f is None:
                continue
            labels.append(f"{r['op']} [{r['impl']}] {r['shape']}")
            fracs.append(f)
            colors.append("tab:blue" if mem else "tab:orange")
        fig, ax = plt.subplots(figsize=(10, 0.3 * len(labels) + 1.5))
        ax.barh(range(len(labels)), fracs, color=colors)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("fraction of measured ceiling (blue: copy TB/s, orange: GEMM TFLOP/s)")
        ax.set_title("deepinfer-model NVIDIA ops on H200")
        fig.tight_layout()
        fig.savefig(out / "run_gpu_suite.png", dpi=110)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out", help="output folder")
    ap.add_argument("--budget-s", type=float, default=310, help="wall-clock budget of the whole suite")
    ap.add_argument("--deep-gemm-build-pid", type=int, default=0, help="pid of the background DeepGEMM build")
    ap.add_argument("--skip-tests", action="store_true", help="do not run pytest")
    ap.add_argument("--deep-gemm-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.deep_gemm_probe:
        deep_gemm_probe(args.out, json.loads(CEIL_FILE.read_text()))
        return
    deadline = T_START + args.budget_s
    props = torch.cuda.get_device_properties(0)
    env = dict(
        kind="env",
        torch=torch.__version__,
        python=platform.python_version(),
        gpu=props.name,
        sms=props.multi_processor_count,
        cuda=torch.version.cuda,
    )
    for mod in ("tilelang", "flash_mla", "deep_gemm"):
        try:
            t0 = time.monotonic()
            m = __import__(mod)
            env[f"{mod}_version"] = str(getattr(m, "__version__", "?"))
            env[f"{mod}_import_s"] = round(time.monotonic() - t0, 2)
        except Exception as e:  # noqa: BLE001
            env[f"{mod}_version"] = f"unavailable: {e!r}"[:200]
    record(**env)
    log(str(env))
    if not args.skip_tests:  # while DeepGEMM builds: test speed does not matter there, timings would
        run_tests(args.out, deadline)
    wait_for_build(args.deep_gemm_build_pid, deadline)
    ceil = measure_ceilings()
    log(f"ceilings {ceil}")
    write_report(args.out)
    try:
        bench_ops(ceil)
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        record(kind="error", where="bench_ops", error=repr(e)[:300])
    write_report(args.out)
    try:
        flash_mla_format_probe()
    except Exception as e:  # noqa: BLE001
        record(kind="error", where="flash_mla_format_probe", error=repr(e)[:300])
    run_deep_gemm(args.out, ceil, deadline)
    write_report(args.out)
    log("done")


if __name__ == "__main__":
    main()
