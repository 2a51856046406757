"""Engram injection's gate and update (`engram_gate`) as one Triton kernel.

Why: after the `kv` projection the reference (`layers.engram.engram_gate`) runs as torch elementwise passes in
the FP32 carrier: a widened copy of the [T, m, H] trunk, `x * k * qk`, the squares and their means, the gate,
`x + g v`, the rounding and the image select, each reading or writing a full [T, m, H] FP32 tensor. In a
16k-token prefill of the medium V4.1 on the H200 that was ~10.7 ms over its 2 Engram layers. Here one program
holds `BLOCK_T` tokens and, for each of the m streams in turn, loads the stream's whole rows of trunk and keys
(one tile of `BLOCK_H` >= H columns), reduces the dot product and both sums of squares over H, forms the gate
and stores the rounded update from the same registers: the trunk, k and v are read once (v once per token for
all streams) and the output is written once, in its own dtype (16-bit in native mode with a narrow trunk).

Serves 16-bit or FP32 trunk, k and v, FP32 `qk`, act / out dtype BF16, FP16 or FP32, H <= `MAX_H` (a row
tile of BLOCK_H columns per stream); the backend calls it in native mode only (FP32 carrier: the reference's
math dtype). Exact mode (FP64 carrier) and other dtypes or widths take the reference.

Numerics: the reference's formula in FP32 with IEEE square roots and divides (`rsqrt` as 1 / sqrt, as torch
on the CPU); the sums over H run in another order than torch's and the sigmoid's exp is the GPU's, so the gate
agrees to FP32 rounding (and `x + g v` may be one fused multiply-add), so a rounded output may differ from
the reference's by one unit of the act dtype.
Image rows are the trunk's values converted to the output dtype. Plain `.py` (Triton reads the source).
"""

import math

import torch
import triton
import triton.language as tl

MAX_H = 8192  # widest trunk row served (V4.1: 4096 medium, 7168 full); wider rows take the reference
# Trunk values per stream and program (BLOCK_T tokens x BLOCK_H columns; one token from H = 4096 on) and per
# thread: 8 values of each operand per thread kept the SM90 BF16 builds at 58-64 registers for H = 2048 .. 8192
# (16 per thread: ~104, a quarter of the SM's warps resident), no spills at any width (ptxas via
# `cuobjdump -res-usage`; not timed on a GPU yet).
TILE = 4096
PER_THREAD = 8


@triton.jit
def _gate_kernel(
    x_ptr,  # [T, M, H] trunk (16-bit or FP32), H contiguous values per stream
    k_ptr,  # [T, M, H] keys, H contiguous values per stream (rows of the kv projection)
    v_ptr,  # [T, H] values, H contiguous
    qk_ptr,  # [M, H] FP32, contiguous
    img_ptr,  # [T] uint8: image token (the trunk is copied)
    out_ptr,  # [T, M, H] out, contiguous
    T,
    H,
    x_st,  # trunk strides of a token and of a stream (elements)
    x_ss,
    k_st,
    k_ss,
    v_st,
    eps,
    sqrt_h,
    M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND_TO: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tok < T
    tok = tok.to(tl.int64)
    c = tl.arange(0, BLOCK_H)
    c_ok = c < H
    ok = t_ok[:, None] & c_ok[None, :]
    n = H.to(tl.float32)
    image = tl.load(img_ptr + tok, mask=t_ok, other=0) != 0
    v = tl.load(v_ptr + tok[:, None] * v_st + c[None, :], mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(M):
        x = tl.load(x_ptr + tok[:, None] * x_st + s * x_ss + c[None, :], mask=ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok[:, None] * k_st + s * k_ss + c[None, :], mask=ok, other=0.0).to(tl.float32)
        q = tl.load(qk_ptr + s * H + c, mask=c_ok, other=0.0)
        dot = tl.sum(x * k * q[None, :], 1)
        xx = tl.div_rn(tl.sum(x * x, 1), n)
        kk = tl.div_rn(tl.sum(k * k, 1), n)
        d = dot * tl.div_rn(1.0, tl.sqrt_rn(xx + eps)) * tl.div_rn(1.0, tl.sqrt_rn(kk + eps))
        d = tl.div_rn(d, sqrt_h)
        sign = tl.where(d > 0.0, 1.0, tl.where(d < 0.0, -1.0, 0.0))
        g = tl.div_rn(1.0, 1.0 + tl.exp(-(sign * tl.sqrt_rn(tl.maximum(tl.abs(d), 1e-6)))))  # (GATE_CLAMP)
        y = (x + g[:, None] * v).to(ROUND_TO).to(tl.float32)
        y = tl.where(image[:, None], x, y)
        out = out_ptr + (tok[:, None] * M + s) * H + c[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=ok)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def supports(
    trunk: torch.Tensor, k: torch.Tensor, v: torch.Tensor, act_dtype: torch.dtype, out_dtype: torch.dtype
) -> bool:
    """Whether the kernel serves these operands: trunk / k / v 16-bit or FP32, act and out dtype BF16, FP16
    or FP32, a trunk row of at most `MAX_H` values."""
    return (
        trunk.dim() == 3
        and all(a.dtype in _TL_DTYPES for a in (trunk, k, v))
        and act_dtype in _TL_DTYPES
        and out_dtype in _TL_DTYPES
        and trunk.shape[-1] <= MAX_H
    )


def _config(h: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_T, num_warps): the row tile, tokens per program, warps (`TILE`, `PER_THREAD`)."""
    block_h = triton.next_power_of_2(max(h, 16))
    block_t = max(1, TILE // block_h)
    return block_h, block_t, max(4, min(32, block_t * block_h // (32 * PER_THREAD)))


def engram_gate(
    trunk: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qk: torch.Tensor,
    image: torch.Tensor,
    eps: float,
    act_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The registry's `engram_gate` (see the module doc for the operands served)."""
    if not supports(trunk, k, v, act_dtype, out_dtype):
        raise ValueError(
            f"engram_gate (Triton): trunk {trunk.dtype} {tuple(trunk.shape)}, k {k.dtype}, v {v.dtype}, act "
            f"{act_dtype}, out {out_dtype}: needs 16-bit or FP32 operands and outputs, H <= {MAX_H}"
        )
    t, m, h = trunk.shape
    if k.shape != trunk.shape or v.shape != (t, h) or qk.shape != (m, h) or image.shape != (t,):
        raise ValueError(
            f"engram_gate: shapes trunk {tuple(trunk.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"qk {tuple(qk.shape)}, image {tuple(image.shape)} do not fit [T, m, H], [T, m, H], [T, H], [m, H], [T]"
        )
    trunk, k, v = (a if a.stride(-1) == 1 else a.contiguous() for a in (trunk, k, v))
    out = torch.empty(t, m, h, dtype=out_dtype, device=trunk.device)
    if t and m and h:
        block_h, block_t, warps = _config(h)
        _gate_kernel[(-(-t // block_t),)](
            trunk, k, v, qk.float().contiguous(), image.to(torch.uint8), out, t, h,
            trunk.stride(0), trunk.stride(1), k.stride(0), k.stride(1), v.stride(0), float(eps), math.sqrt(h),
            M=m, BLOCK_T=block_t, BLOCK_H=block_h, ROUND_TO=_TL_DTYPES[act_dtype], num_warps=warps,
        )  # fmt: skip
    return out
