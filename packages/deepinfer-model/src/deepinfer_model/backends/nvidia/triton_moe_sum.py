"""The routed experts summed per token (`expert_swiglu_sum`): grouped GEMMs, then two Triton kernels.

Why: the grouped-GEMM reference (`layers.experts.grouped_swiglu`) carries every (token, slot) pair's
intermediate values in FP32 between torch ops and scatters the [T*k, H] FP32 down projections back to pair
order before `_slot_sum` adds the k slots. In a 16k-token medium V4.1 prefill on the H200 that was ~43 ms of
a 279 ms step beside 19 ms of expert GEMMs: the widening copies after each GEMM (10 ms), the 1.6 GB scatter
per layer (11 ms), the slot sum's six passes over [T, H] FP32 (10 ms) and the SwiGLU's clamp / sigmoid /
multiply passes (8 ms). Here:

* gate and up stay `torch._grouped_mm` (CUTLASS, near the BF16 rate at prefill sizes) with 16-bit outputs;
* `_swiglu_kernel` reads both and writes `h` (16-bit, the routing weight applied when it comes before the
  down projection): one pass instead of ~8;
* the down projection is `torch._grouped_mm` too, its 16-bit output left in expert order;
* `_combine_kernel` gathers each token's k rows through the inverse permutation, adds them in slot order in
  FP32 from +0 (as `_slot_sum`), adds the shared expert's output and rounds once: one pass over 16-bit rows,
  no scatter, no FP32 [T*k, H] tensor.

Few pairs (a decode step) keep `triton_moe.expert_swiglu`'s kernels, whose FP32 pair-order output goes
through the same combine kernel (one launch instead of the slot sum's k + 3).

Numerics: the reference's (BF16 GEMM outputs, FP32 SwiGLU and weighting, `h` rounded to the act dtype, the
slot sum in FP32 in slot order, one rounding). The SwiGLU's exp is Triton's (approximate on the GPU), so a
rounded `h` may differ from torch's in the last bit; the sums are the reference's additions in its order.
Plain `.py` (Triton reads the source).
"""

import torch
import triton
import triton.language as tl
from deepinfer_cluster import envs

from . import triton_moe

BLOCK_COLS = 1024  # columns per program of both kernels


@triton.jit
def _swiglu_kernel(
    g_ptr,  # [P, N] 16-bit gate projections
    u_ptr,  # [P, N] 16-bit up projections
    ws_ptr,  # [P] FP32 routing weights (rows of g / u), read when WEIGHTED
    h_ptr,  # [P, N] 16-bit out
    N,
    limit,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < N
    g = tl.load(g_ptr + r * N + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * N + c, mask=ok, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    h = g * tl.sigmoid(g) * tl.minimum(tl.maximum(u, -limit), limit)
    if WEIGHTED:
        h = h * tl.load(ws_ptr + r)
    tl.store(h_ptr + r * N + c, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_kernel(
    y_ptr,  # [P, H] per-pair outputs (16-bit or FP32), row pos[p] holds pair p
    pos_ptr,  # [P] int64 row of each pair in y (read when GATHER, else row p)
    ws_ptr,  # [P] FP32 routing weights by pair (read when WEIGHTED)
    add_ptr,  # [T, H] addend (read when HAS_ADD)
    out_ptr,  # [T, H] out
    H,
    K_SLOTS: tl.constexpr,
    GATHER: tl.constexpr,
    WEIGHTED: tl.constexpr,
    HAS_ADD: tl.constexpr,
    ROUND_TO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    acc = tl.zeros([BLOCK], tl.float32)  # +0: 0 + y is y except for -0.0, as the reference's zeros
    for s in tl.static_range(K_SLOTS):
        p = t * K_SLOTS + s
        if GATHER:
            row = tl.load(pos_ptr + p)
        else:
            row = p
        v = tl.load(y_ptr + row * H + c, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(ws_ptr + p)
        acc = acc + v
    if HAS_ADD:
        acc = acc + tl.load(add_ptr + t * H + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + c, acc.to(ROUND_TO).to(out_ptr.dtype.element_ty), mask=ok)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _block(n: int) -> int:
    return min(BLOCK_COLS, triton.next_power_of_2(max(n, 16)))


def swiglu_supports(
    gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: torch.dtype | None = None
) -> bool:
    """Whether `swiglu_op` takes these operands: contiguous, of one 16-bit dtype, rounded into it."""
    same = up.dtype == gate.dtype and (out_dtype or gate.dtype) == gate.dtype
    narrow = gate.dtype in (torch.bfloat16, torch.float16)
    return same and narrow and gate.is_contiguous() and up.is_contiguous()


def swiglu_op(
    gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The registry's `swiglu` for the operands `swiglu_supports` takes (the shared expert's [T, I] rows)."""
    if not swiglu_supports(gate, up, limit, out_dtype):
        raise ValueError(
            f"swiglu (Triton): contiguous gate / up of one 16-bit dtype and that output, got {gate.dtype}, "
            f"{up.dtype}, out {out_dtype}"
        )
    n = gate.shape[-1]
    return swiglu(gate.view(-1, n), up.view(-1, n), None, limit).view(gate.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None, limit: float) -> torch.Tensor:
    """h = silu(min(gate, L)) * clamp(up, -L, L) (* weights per row) in FP32, rounded to gate's dtype."""
    p, n = gate.shape
    h = torch.empty_like(gate)
    if p and n:
        ws = gate if weights is None else weights.float().contiguous()  # (never read unweighted)
        block = _block(n)
        _swiglu_kernel[(p, -(-n // block))](
            gate, up, ws, h, n, float(limit), WEIGHTED=weights is not None, BLOCK=block, num_warps=4
        )
    return h


def combine(
    y: torch.Tensor,
    k: int,
    positions: torch.Tensor | None,
    weights: torch.Tensor | None,
    addend: torch.Tensor | None,
    act_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """[T, H] out_dtype: for each token t, the FP32 sum over slots s = 0 .. k-1 (in order, from +0) of
    y[positions[t*k + s]] (* weights[t*k + s]), plus addend[t], rounded to act_dtype. `positions` None: row p
    holds pair p."""
    pairs, hidden = y.shape
    t = pairs // k if k else 0
    out = torch.empty(t, hidden, dtype=out_dtype, device=y.device)
    if t and hidden:
        block = _block(hidden)
        _combine_kernel[(t, -(-hidden // block))](
            y, y if positions is None else positions, y if weights is None else weights.float().contiguous(),
            y if addend is None else addend.contiguous(), out, hidden,
            K_SLOTS=k, GATHER=positions is not None, WEIGHTED=weights is not None, HAS_ADD=addend is not None,
            ROUND_TO=_TL_DTYPES[act_dtype], BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def grouped_supports(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """16-bit operands of one dtype (the grouped GEMMs' and the kernels' inputs)."""
    return x.dtype in (torch.bfloat16, torch.float16) and w1.dtype == x.dtype


def expert_swiglu_sum(
    x: torch.Tensor,
    pairs: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weight_before_down: bool,
    addend: torch.Tensor | None,
    act_dtype: torch.dtype,
    out_dtype: torch.dtype,
    max_pairs: int | None = None,
) -> torch.Tensor:
    """The registry's `expert_swiglu_sum` for 16-bit `x` and weights of its dtype (see the module doc). Calls
    of at most `max_pairs` pairs run the few-pairs kernels (None: `DEEPINFER_TRITON_MOE_MAX_PAIRS` now; the
    op table passes the value it was built under)."""
    if not grouped_supports(x, w1) or w3.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"expert_swiglu_sum (Triton): x and weights must share a 16-bit dtype, got {x.dtype}, {w1.dtype}"
        )
    if act_dtype not in _TL_DTYPES:
        raise ValueError(
            f"expert_swiglu_sum: act_dtype must be bfloat16, float16 or float32, got {act_dtype}"
        )
    t = x.shape[0]
    p = pairs.numel()
    if p % max(t, 1):
        raise ValueError(f"expert_swiglu_sum: pairs ({p}) must be a multiple of the token count ({t})")
    k = p // t if t else 1
    if max_pairs is None:
        max_pairs = envs.get("DEEPINFER_TRITON_MOE_MAX_PAIRS")
    if p <= max_pairs:  # a decode step: the few-pairs kernels (weights applied there)
        y = triton_moe.expert_swiglu(x, pairs, weights, w1, w3, w2, limit, weight_before_down)
        return combine(y, k, None, None, addend, act_dtype, out_dtype)
    flat = pairs.reshape(-1).long()
    order, ends = triton_moe.sort_pairs(flat, w1.shape[0])
    xs = x[torch.div(order, k, rounding_mode="floor")]  # row i: token of pair order[i]
    gate = torch._grouped_mm(xs, w1.transpose(1, 2), offs=ends)
    up = torch._grouped_mm(xs, w3.transpose(1, 2), offs=ends)
    ws = weights.reshape(-1).float()
    h = swiglu(gate, up, ws[order] if weight_before_down else None, limit)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)  # expert order
    positions = torch.empty_like(order)
    positions[order] = torch.arange(p, device=order.device)
    return combine(y, k, positions, None if weight_before_down else ws, addend, act_dtype, out_dtype)
