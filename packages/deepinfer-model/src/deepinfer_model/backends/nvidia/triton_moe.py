"""The routed experts' SwiGLU MLP for few (token, slot) pairs: two Triton kernels over the expert-sorted pairs.

Why: in a decode step each expert sees a handful of rows, so the work is reading the active experts'
weights once. `torch._grouped_mm` (CUTLASS) tiles N by 128 or more: at one token (6 pairs) the medium
V4.1's gate projection is 6 experts x 8 tiles = 48 CTAs on 132 SMs, and the three projections of a layer
took 26 us each on the H200, about half the HBM rate. Here a program owns one expert and a narrow block of
output columns (`block_n`), so the same call is hundreds of programs that stream the weights at full
width; gate and up are read in the same program and the clamped SwiGLU is its epilogue; the token rows are
gathered and the outputs scattered back to pair order inside the kernels (no gather, cast or scatter
launches around them).

Numerics are those of the grouped-GEMM path (`layers.experts.grouped_swiglu`): BF16 operands, FP32
accumulation, each projection's output rounded to BF16, the SwiGLU and routing weight in FP32, `h`
rounded to BF16 before the down projection. The K order of the sums differs from CUTLASS's, so results
agree within FP32 accumulation order, not bitwise. Plain `.py` (Triton reads the source).
"""

import torch
import triton
import triton.language as tl
from deepinfer_cluster import envs

BLOCK_K = 128  # reduction depth per loaded tile (the weight rows are contiguous in K)


@triton.jit
def _plan_kernel(
    pairs_ptr,  # [P] int: expert of each pair
    order_ptr,  # [P] int64 out: pair id of each sorted row (stable: a token-major order within an expert)
    ends_ptr,  # [E] int32 out: sorted rows of experts <= e
    P,
    E,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # one program: a counting sort of the pairs by expert as a [pairs, experts] one-hot tile (what an argsort,
    # a searchsorted and their casts did in four to six launches)
    i = tl.arange(0, BLOCK_P)
    ex = tl.arange(0, BLOCK_E)
    ids = tl.load(pairs_ptr + i, mask=i < P, other=-1).to(tl.int32)
    hot = ids[:, None] == ex[None, :]  # (padding and out-of-range ids match no expert)
    hot_i = hot.to(tl.int32)
    counts = tl.sum(hot_i, 0)
    ends = tl.cumsum(counts, 0)
    tl.store(ends_ptr + ex, ends, mask=ex < E)
    rank = tl.sum(tl.where(hot, tl.cumsum(hot_i, 0), 0), 1) - 1  # earlier pairs of the same expert
    start = tl.sum(tl.where(hot, (ends - counts)[None, :], 0), 1)
    tl.store(order_ptr + start + rank, i.to(tl.int64), mask=rank >= 0)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, K] 16-bit token rows
    order_ptr,  # [P] int64: pair id of each sorted row
    ends_ptr,  # [E] int32: sorted rows of experts <= e
    w1_ptr,  # [E, N, K] gate
    w3_ptr,  # [E, N, K] up
    ws_ptr,  # [P] FP32 routing weight of each pair
    h_ptr,  # [P, N] 16-bit out, sorted-row order
    K,
    N,
    k_slots,
    limit,
    WEIGHT_BEFORE_DOWN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    w_base = e.to(tl.int64) * N * K
    for m0 in range(start, end, BLOCK_M):
        r = m0 + tl.arange(0, BLOCK_M)
        r_ok = r < end
        pair = tl.load(order_ptr + r, mask=r_ok, other=0)
        tok = pair // k_slots
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(x_ptr + tok[:, None] * K + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w_off = w_base + n[:, None] * K + kk[None, :]
            w_ok = n_ok[:, None] & k_ok[None, :]
            acc_g = tl.dot(a, tl.trans(tl.load(w1_ptr + w_off, mask=w_ok, other=0.0)), acc_g)
            acc_u = tl.dot(a, tl.trans(tl.load(w3_ptr + w_off, mask=w_ok, other=0.0)), acc_u)
        # each projection rounded to the act dtype, as the GEMM path's outputs are
        g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
        g = tl.minimum(g, limit)
        h = g * tl.sigmoid(g) * tl.minimum(tl.maximum(u, -limit), limit)
        if WEIGHT_BEFORE_DOWN:
            h = h * tl.load(ws_ptr + pair, mask=r_ok, other=0.0)[:, None]
        tl.store(
            h_ptr + r[:, None] * N + n[None, :],
            h.to(h_ptr.dtype.element_ty),
            mask=r_ok[:, None] & n_ok[None, :],
        )


@triton.jit
def _down_kernel(
    h_ptr,  # [P, K] 16-bit, sorted-row order
    order_ptr,
    ends_ptr,
    w2_ptr,  # [E, N, K]
    ws_ptr,
    y_ptr,  # [P, N] FP32 out, pair order
    K,
    N,
    WEIGHT_BEFORE_DOWN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    w_base = e.to(tl.int64) * N * K
    for m0 in range(start, end, BLOCK_M):
        r = m0 + tl.arange(0, BLOCK_M)
        r_ok = r < end
        pair = tl.load(order_ptr + r, mask=r_ok, other=0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(h_ptr + r[:, None] * K + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w_off = w_base + n[:, None] * K + kk[None, :]
            w = tl.load(w2_ptr + w_off, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        y = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
        if not WEIGHT_BEFORE_DOWN:
            y = y * tl.load(ws_ptr + pair, mask=r_ok, other=0.0)[:, None]
        tl.store(y_ptr + pair[:, None] * N + n[None, :], y, mask=r_ok[:, None] & n_ok[None, :])


# Pair counts up to which the registry takes these kernels; above it, the grouped GEMMs. On the H200 (medium
# V4.1 experts, `benchmarks/gpu/bench_expert_swiglu.py`) the kernels took 0.48-0.59x the grouped
# GEMMs' time from 6 to 768 pairs; prefill chunks (thousands of pairs) were not measured with them.
# DEEPINFER_TRITON_MOE_MAX_PAIRS overrides it when the op table is built (0: never these kernels).
MAX_PAIRS: int = envs.VARS["DEEPINFER_TRITON_MOE_MAX_PAIRS"].default

# Column blocks (gate/up, down) and warps. The same H200 sweep: 32 / 64 columns were the fastest at one token
# (6 pairs: 65 us against 68 us with 64 / 128), 64 / 128 from 8 tokens on (126 against 133 us at 48 pairs).
CONFIGS = {"gate_up_block_n": 32, "down_block_n": 64, "num_warps": 4, "num_stages": 4}
WIDE_FROM_PAIRS = 16  # from this many pairs on: 64 / 128 columns
WIDE = {"gate_up_block_n": 64, "down_block_n": 128}


def supports(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """16-bit operands of one dtype (FP32 would run `tl.dot` in TF32, not the reference's FP32)."""
    return x.dtype in (torch.bfloat16, torch.float16) and w1.dtype == x.dtype


def _block_m(pairs: int, experts: int) -> int:
    """Rows per tile: 16 (the smallest `tl.dot`) up to 64 as the mean rows per expert grow."""
    per_expert = -(-pairs // max(experts, 1))
    return min(64, max(16, triton.next_power_of_2(per_expert)))


# Largest one-hot tile (pairs x experts, both padded to powers of two) the one-program sort takes; beyond it
# (many pairs or a large expert count) the sort is torch's argsort.
PLAN_TILE = 1 << 16


def sort_pairs(pairs: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [P] int64, ends [E] int32): the pair ids sorted by expert (stable) and each expert's end row,
    as `torch.argsort(pairs, stable=True)` and `searchsorted(..., right=True)` give them. Ids outside
    [0, E) belong to no expert (their pairs are left out of `order`'s first `ends[-1]` rows)."""
    p = pairs.numel()
    bp, be = triton.next_power_of_2(max(p, 1)), triton.next_power_of_2(max(n_experts, 1))
    if bp * be > PLAN_TILE:
        flat = pairs.long()
        order = torch.argsort(flat, stable=True)
        expert = torch.arange(n_experts, device=pairs.device)
        return order, torch.searchsorted(flat[order], expert, right=True).to(torch.int32)
    order = torch.empty(p, dtype=torch.int64, device=pairs.device)
    ends = torch.empty(n_experts, dtype=torch.int32, device=pairs.device)
    _plan_kernel[(1,)](
        pairs, order, ends, p, n_experts, BLOCK_P=bp, BLOCK_E=be, num_warps=4 if bp * be <= 8192 else 8
    )
    return order, ends


def expert_swiglu(
    x: torch.Tensor,
    pairs: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weight_before_down: bool,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """The registry's `expert_swiglu` contract for 16-bit `x` and weights of its dtype: [P, H] FP32, pair order.
    `config`: `CONFIGS`' keys to override (the bench's sweep)."""
    if not supports(x, w1) or w3.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"expert_swiglu (Triton): x and weights must share a 16-bit dtype, got {x.dtype}, {w1.dtype}"
        )
    t, hidden = x.shape
    n_experts, inter = w1.shape[0], w1.shape[1]
    p = pairs.numel()
    if p % max(t, 1):
        raise ValueError(f"expert_swiglu: pairs ({p}) must be a multiple of the token count ({t})")
    k = p // t if t else 1
    y = torch.empty(p, hidden, dtype=torch.float32, device=x.device)
    if not p:
        return y
    order, ends = sort_pairs(pairs.reshape(-1), n_experts)
    ws = weights.reshape(-1).float().contiguous()
    h = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    bm = _block_m(p, n_experts)
    cfg = {**CONFIGS, **(WIDE if p >= WIDE_FROM_PAIRS else {}), **(config or {})}
    run = {"BLOCK_M": bm, "BLOCK_K": BLOCK_K, "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    bn = cfg["gate_up_block_n"]
    _gate_up_kernel[(n_experts, triton.cdiv(inter, bn))](
        x.contiguous(), order, ends, w1.contiguous(), w3.contiguous(), ws, h,
        hidden, inter, k, float(limit), WEIGHT_BEFORE_DOWN=bool(weight_before_down), BLOCK_N=bn, **run,
    )  # fmt: skip
    bn = cfg["down_block_n"]
    _down_kernel[(n_experts, triton.cdiv(hidden, bn))](
        h, order, ends, w2.contiguous(), ws, y,
        inter, hidden, WEIGHT_BEFORE_DOWN=bool(weight_before_down), BLOCK_N=bn, **run,
    )  # fmt: skip
    return y
