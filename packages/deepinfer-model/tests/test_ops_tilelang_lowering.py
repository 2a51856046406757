"""The TileLang kernels lower to CUDA for SM90 (no GPU needed; skipped without the `nvidia` extra).

Catches front-end errors (annotations, layouts, loop forms) before a device run; numerics are checked
on the GPU by test_ops_nvidia.py.
"""

from __future__ import annotations

import pytest

tilelang = pytest.importorskip("tilelang")

from deepinfer_model.backends.nvidia import tilelang_mhc, tilelang_norm, tilelang_rope  # noqa: E402

PROGRAMS = {
    "norm_bf16": lambda: tilelang_norm._norm_program(512, "bfloat16", "bfloat16", 1e-6, 128),
    "norm_f32_to_bf16": lambda: tilelang_norm._norm_program(1536, "float32", "bfloat16", 1e-6, 128),
    "rope_with_passthrough": lambda: tilelang_rope._rope_program(512, 32, 64, "float32", "bfloat16"),
    "rope_all_channels": lambda: tilelang_rope._rope_program(128, 64, 4, "bfloat16", "bfloat16"),
    "rope_tail_in_place": lambda: tilelang_rope._rope_tail_program(512, 32, 64, "bfloat16"),
    "rope_tail_all_channels": lambda: tilelang_rope._rope_tail_program(128, 64, 4, "float32"),
    "rope_tail_uneven_block": lambda: tilelang_rope._rope_tail_program(96, 24, 3, "bfloat16"),
    "hc_read": lambda: tilelang_mhc._read_program(4, 7168, "bfloat16", "bfloat16"),
    "hc_read_small_block": lambda: tilelang_mhc._read_program(4, 96, "float32", "float32"),
    "hc_write": lambda: tilelang_mhc._write_program(4, 7168, "float32", "float32", "bfloat16"),
    "hc_mixes_epilogue": lambda: tilelang_mhc._mixes_program(4, 20, 1e-6),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_kernel_lowers_to_cuda_for_sm90(name):
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        lowered = tilelang.lower(PROGRAMS[name](), target=target)
    source = getattr(lowered, "kernel_source", None) or str(lowered)
    assert "__global__" in source


# --- the lowered CUDA run on the CPU: each kernel here has no __syncthreads, so calling it once per
# (block, thread) in any order is its semantics. A check of the generated index math and casts against
# the CPU reference; vector-load alignment and real launches are left to test_ops_nvidia.py. ---

_SHIM = r"""
#include <cstdint>
#include <cmath>
#include <cstring>
#include <algorithm>
using std::max; using std::min;
struct Dim { int x, y, z; };
extern "C" { Dim blockIdx; Dim threadIdx; }
struct bfloat16_t { uint16_t v; bfloat16_t() = default;
  bfloat16_t(float f) { uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) v = (uint16_t)((u >> 16) | 0x40);
    else { u += 0x7fffu + ((u >> 16) & 1u); v = (uint16_t)(u >> 16); } }
  operator float() const { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; } };
struct __nv_bfloat162 { bfloat16_t x, y; };
struct float2 { float x, y; }; struct float4 { float x, y, z, w; };
struct uint2 { uint32_t x, y; }; struct uint4 { uint32_t x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {float(h.x), float(h.y)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return {bfloat16_t(f.x), bfloat16_t(f.y)}; }
#define __global__
#define __launch_bounds__(a, b)
#define __restrict__
"""


def _run_on_cpu(tmp_path, program, grid: tuple[int, int], args: dict) -> None:
    import ctypes
    import re
    import shutil
    import subprocess

    import torch
    from tvm.target import Target

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    target = Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        source = tilelang.lower(program, target=target).kernel_source
    body = source[source.index('extern "C"') :]
    assert "__syncthreads" not in body
    sig = re.search(r"__launch_bounds__\((\d+), 1\) (\w+)\(([^)]*)\)", body)
    cpp, so = tmp_path / f"{sig.group(2)}.cpp", tmp_path / f"{sig.group(2)}.so"  # dlopen caches by path
    cpp.write_text(_SHIM + body)
    subprocess.run(
        ["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-fno-strict-aliasing", cpp, "-o", so], check=True
    )
    lib = ctypes.CDLL(str(so))
    threads, fn = int(sig.group(1)), getattr(lib, sig.group(2))
    names = [p.strip().split()[-1].removesuffix("_1") for p in sig.group(3).split(",")]
    cargs = [
        ctypes.c_void_p(args[n].data_ptr()) if isinstance(args[n], torch.Tensor) else ctypes.c_int(args[n])
        for n in names
    ]
    block, thread = (ctypes.c_int * 3).in_dll(lib, "blockIdx"), (ctypes.c_int * 3).in_dll(lib, "threadIdx")
    for by in range(grid[1]):
        for bx in range(grid[0]):
            block[0], block[1] = bx, by
            for t in range(threads):
                thread[0] = t
                fn(*cargs)


def _rel(got, ref) -> float:
    import torch

    assert bool(torch.isfinite(got).all()), "unwritten (NaN) or non-finite output"
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_kernel_logic_on_cpu(tmp_path, inverse):
    import torch
    from deepinfer_model.ops import get_ops

    x, ang = torch.randn(3, 4, 512), torch.rand(3, 32) * 50
    cos, sin = ang.cos(), ang.sin()
    y = torch.full((12, 512), float("nan"), dtype=torch.bfloat16)
    args = dict(x=x.reshape(12, 512), cos=cos, sin=-sin if inverse else sin, y=y, rows=12, tokens=3)
    _run_on_cpu(tmp_path, tilelang_rope._rope_program(512, 32, 4, "float32", "bfloat16"), (12, 1), args)
    ref = get_ops("cpu").apply_rope(x, cos, sin, inverse, out_dtype=torch.bfloat16)
    assert torch.equal(y.view(3, 4, 512), ref)  # same FP32 math, same single rounding


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,heads,channels,half", [(37, 2, 512, 32), (5, 3, 96, 24), (3, 1, 64, 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_kernel_logic_on_cpu(tmp_path, dtype_name, tokens, heads, channels, half, inverse):
    """The in-place kernel over several CTAs of rows (the last one partly past the rows): its tail is the
    out-of-place kernel's output bit for bit (both run here; the same rotation written the same way), the
    leading channels keep their bits, and it equals the registry's `apply_rope_` (FP32 within rounding)."""
    import torch
    from deepinfer_model.ops import get_ops

    dt, rows = getattr(torch, dtype_name), tokens * heads
    x = torch.randn(tokens, heads, channels).to(dt)
    ang = torch.rand(tokens, half) * 50
    cos, sin = ang.cos(), ang.sin()
    sin_arg = -sin if inverse else sin
    y = torch.full((rows, channels), float("nan"), dtype=dt)
    args = dict(x=x.reshape(rows, channels), cos=cos, sin=sin_arg, y=y, rows=rows, tokens=tokens)
    _run_on_cpu(
        tmp_path, tilelang_rope._rope_program(channels, half, heads, dtype_name, dtype_name), (rows, 1), args
    )
    got = x.clone()
    block = tilelang_rope._rows_per_cta(half)
    args = dict(x=got.view(rows, channels), cos=cos, sin=sin_arg, rows=rows, tokens=tokens)
    _run_on_cpu(
        tmp_path,
        tilelang_rope._rope_tail_program(channels, half, heads, dtype_name),
        (-(-rows // block), 1),
        args,
    )
    lead = channels - 2 * half
    assert torch.equal(got[..., :lead], x[..., :lead])  # not written
    assert torch.equal(got, y.view(x.shape))  # the out-of-place kernel's bits
    ref = x.clone()
    get_ops("cpu").apply_rope_(ref, cos, sin, inverse)
    if dt == torch.bfloat16:
        assert torch.equal(got, ref)
    else:  # FP32 products and sum (the kernel) against the reference's FP64 ones, each rounded to FP32
        assert _rel(got, ref) < 1e-6


@pytest.mark.parametrize("dtype_name,hidden", [("float32", 96), ("bfloat16", 1024)])
def test_mhc_kernels_logic_on_cpu(tmp_path, dtype_name, hidden):
    import torch
    from deepinfer_model.ops import get_ops

    cpu, dt, t, m = get_ops("cpu"), getattr(torch, dtype_name), 3, 4
    tol = 1e-5 if dt == torch.float32 else 8e-3
    trunk = (torch.randn(t, m, hidden) * 2).to(dt)
    fn, base, scale = (
        torch.randn(24, m * hidden) * (m * hidden) ** -0.5,
        torch.randn(24) * 0.1,
        torch.rand(3) + 0.5,
    )
    pre, post, comb = cpu.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, 20)
    grid = (hidden // tilelang_mhc._block(hidden), t)
    y = torch.full((t, hidden), float("nan"), dtype=dt)
    _run_on_cpu(
        tmp_path,
        tilelang_mhc._read_program(m, hidden, dtype_name, dtype_name),
        grid,
        dict(trunk=trunk, w=pre, y=y, tokens=t),
    )
    assert _rel(y, cpu.hc_read(trunk, pre)) < tol
    y_in, out = torch.randn(t, hidden).to(dt), torch.full((t, m, hidden), float("nan"), dtype=dt)
    args = dict(y=y_in, trunk=trunk, post=post, comb=comb, out=out, tokens=t)
    _run_on_cpu(
        tmp_path, tilelang_mhc._write_program(m, hidden, dtype_name, dtype_name, dtype_name), grid, args
    )
    assert _rel(out, cpu.hc_write(y_in, trunk, post, comb)) < tol
    flat = trunk.float().flatten(1)  # the projection the wrapper does with cuBLAS
    rstd, z = torch.rsqrt(flat.square().mean(-1) + 1e-6), flat @ fn.t()
    got = [
        torch.full((t, m), float("nan")),
        torch.full((t, m), float("nan")),
        torch.full((t, m, m), float("nan")),
    ]
    args = dict(z=z, rstd=rstd, scale=scale, base=base, pre=got[0], post=got[1], comb=got[2], tokens=t)
    _run_on_cpu(tmp_path, tilelang_mhc._mixes_program(m, 20, 1e-6), (1, 1), args)
    for g, r in zip(got, (pre, post, comb), strict=True):
        assert _rel(g, r) < 1e-5
