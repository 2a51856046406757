"""Batch-invariant mode's GEMMs on CUDA, as Triton kernels: row GEMMs and tile products whose bits do not
depend on how many rows or products share the call.

Why: cuBLAS picks its kernel (tile shape, split-K) from the whole problem, so a row's bits follow the
token count of the step. The reference path (`batch_invariant.tiled_matmul`) therefore multiplies every
row in a fixed [8, K] tile, 16 tiles per bmm call, which pads a decode row to 128 rows: the LM head of a
one-sequence decode step did 128 rows of FP64 work (0.51 ms of a 9.4 ms tiny-model step on an H200).

Here one program computes one row against a block of `BLOCK_N` columns (`WIDE_BLOCK_N` for a weight of
at least `WIDE_N` columns), summing `BLOCK_K`-wide products in K order. The compiled kernel is fixed by the dtypes and the block sizes, never by the row
count (`m` is not specialised), so a row's result is a function of that row and the weight alone, at any
batch size and any row index, and costs one row of work. `rows_matmul` (one shared weight, the
projections and the LM head) and `pair_rows_matmul` (row p against expert `pairs[p]`, the graph-safe
expert path) run the same kernel and differ only in the weight's base address, so a row gets the same
bits from either as long as the weight is passed in the same dtype and layout (both callers pass the
stored weight, widened in the kernel). A projection's rounding to its activation dtype happens in the same kernel (`round_to`), as the value
is stored: two elementwise kernels fewer per projection of a step. `row_sum_squares` is the row-local
statistic of the mHC norm.
`tile_bmm` is the attention's fixed-shape tile products ([8, D] x [D, 32] scores, [8, 32] x [32, D + 1]
P.[K | 1]) for any number of products, direct or gathered by index, in one launch (the reference issues
cuBLAS calls of exactly 16 matrices, one per key tile in prefill: ~10,000 extra ATen calls per tiny-model
prefill step at batch 8).

Not fast for large M (each row re-reads the weight through L2): batch-invariant prefill of a large model
pays for it; decode is one pass over the weight. Plain `.py` (Triton reads the source).
"""

import functools

import torch
import triton
import triton.language as tl

from .triton_launch import DirectLaunch

BLOCK_N = 16  # small column blocks: decode rows of small projections still spread over many programs
BLOCK_K = 128  # wide K blocks: few loop iterations (a step of the tiny model is latency-bound)
# Weights of at least WIDE_N columns (the LM head) take wider column blocks: with 16 columns the LM head's
# 129,280 columns made 8,080 programs per row, 64,640 at batch 8, in ~30 waves of short programs. Measured on
# the H200 at batch 8: 299 us before, 284 us with these blocks, 75 us for cuBLAS FP64 (so the waves were
# not what bounds it). The blocks are a function of N alone, so a weight gets one compiled variant,
# whatever the row count (and `pair_rows_matmul` the same one as `rows_matmul`).
WIDE_N = 8192
WIDE_BLOCK_N = 128
WIDE_BLOCK_K = 32  # (a [32, 128] FP64 product tile per step: 32 registers per thread, as [128, 16])
SUMSQ_BLOCK = 1024
TILE_N = 32  # `tile_bmm`: output columns per program (a key tile's 32 scores; P.V in blocks of 32)
TILE_K = 16
_ACC = {torch.float64: tl.float64, torch.float32: tl.float32}
# `rows_matmul(..., round_to=)`: the kernel's ROUND constexpr per dtype (0: the sums as accumulated)
_ROUND_CODES = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


# One compiled kernel per dtype combination: no argument is specialised on its value (Triton otherwise
# compiles variants for arguments equal to 1 or divisible by 16) or on its alignment (pointers aligned to
# 16 bytes or not), since a variant may lay out and reduce the tile in another order. K is contiguous in
# both operands (checked by the callers), which keeps the loads coalesced without alignment hints.
_INTS = ["m", "n", "k", "stride_xm", "stride_idx", "stride_we", "stride_wn", "stride_om"]
_PTRS = ["x_ptr", "w_ptr", "idx_ptr", "out_ptr"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def _rows_kernel(
    x_ptr,
    w_ptr,
    idx_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_idx,
    stride_we,
    stride_wn,
    stride_om,
    ACC: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ROUND: tl.constexpr,
):
    # row `row` of x times the weight at w_ptr + idx[row * stride_idx] * stride_we: one shared weight
    # (stride_idx = stride_we = 0) and one expert per row are the same kernel, so the same bits
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    w_base = w_ptr + tl.load(idx_ptr + row * stride_idx).to(tl.int64) * stride_we
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BN,), dtype=ACC)
    for k0 in range(0, k, BK):
        kk = k0 + ks
        a = tl.load(x_row + kk, mask=kk < k, other=0.0).to(ACC)
        b_ptrs = w_base + kk[:, None] + cols[None, :].to(tl.int64) * stride_wn
        b = tl.load(b_ptrs, mask=(kk[:, None] < k) & (cols[None, :] < n), other=0.0).to(ACC)
        acc += tl.sum(a[:, None] * b, axis=0)
    # ROUND (see `_ROUND_CODES`): each sum rounded to FP32 / BF16 / FP16 and stored widened again, the
    # values torch's `.to(dtype).to(x.dtype)` gives (torch narrows FP64 to FP32 first, to nearest even,
    # then to the 16-bit type: the same two conversions)
    if ROUND == 1:
        acc = acc.to(tl.float32).to(ACC)
    elif ROUND == 2:
        acc = acc.to(tl.float32).to(tl.bfloat16, fp_downcast_rounding="rtne").to(ACC)
    elif ROUND == 3:
        acc = acc.to(tl.float32).to(tl.float16, fp_downcast_rounding="rtne").to(ACC)
    tl.store(out_ptr + row * stride_om + cols, acc, mask=cols < n)


@triton.jit(do_not_specialize=["m", "k", "stride_xm"], do_not_specialize_on_alignment=["x_ptr", "out_ptr"])
def _sumsq_kernel(x_ptr, out_ptr, m, k, stride_xm, BK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, k, BK):
        kk = k0 + ks
        a = tl.load(x_ptr + row * stride_xm + kk, mask=kk < k, other=0.0).to(tl.float32)
        acc += a * a
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


_TILE_INTS = ["n_out", "m", "k", "n", "stride_ia", "step_a", "stride_ib", "step_b", "sa_b", "sa_m", "sb_b", "sb_k",
              "so_b", "so_m"]  # fmt: skip


@triton.jit(
    do_not_specialize=_TILE_INTS,
    do_not_specialize_on_alignment=["a_ptr", "b_ptr", "ia_ptr", "ib_ptr", "out_ptr"],
)
def _tiles_kernel(
    a_ptr, b_ptr, ia_ptr, ib_ptr, out_ptr, n_out, m, k, n,
    stride_ia, step_a, stride_ib, step_b, sa_b, sa_m, sb_b, sb_k, so_b, so_m,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # product j = a[ia[j * stride_ia] + j * step_a] @ b[ib[j * stride_ib] + j * step_b]: indexed and direct
    # products (index = a zero, stride 0, step 1) are the same kernel
    j = tl.program_id(0).to(tl.int64)
    mat_a = tl.load(ia_ptr + j * stride_ia).to(tl.int64) + j * step_a
    mat_b = tl.load(ib_ptr + j * stride_ib).to(tl.int64) + j * step_b
    rows = tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float64)
    for k0 in range(0, k, BK):
        kk = k0 + ks
        a = tl.load(
            a_ptr + mat_a * sa_b + rows[:, None] * sa_m + kk[None, :],
            mask=(rows[:, None] < m) & (kk[None, :] < k), other=0.0,
        )  # fmt: skip
        b = tl.load(
            b_ptr + mat_b * sb_b + kk[:, None] * sb_k + cols[None, :],
            mask=(kk[:, None] < k) & (cols[None, :] < n), other=0.0,
        )  # fmt: skip
        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    out = out_ptr + j * so_b + rows[:, None] * so_m + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < m) & (cols[None, :] < n))


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1). Plain Python: `triton.next_power_of_2` and `triton.cdiv` are
    constexpr functions, whose host calls unwrap their arguments first (~1 ms per batch-invariant eager step
    on the H200, cProfile)."""
    return 1 << (n - 1).bit_length()


# repeated launches skip the JIT's per-call binding (triton_launch.py): the mode's eager steps are host-bound
_ROWS, _TILES, _SUMSQ = DirectLaunch(_rows_kernel), DirectLaunch(_tiles_kernel), DirectLaunch(_sumsq_kernel)


# One zero expert index per device: the shared-weight calls read it for every row (stride 0). Made
# outside a CUDA-graph capture only (one made during a capture would live in that graph's pool).
_ZERO_IDX: dict[torch.device, torch.Tensor] = {}


def _zero_idx(device: torch.device) -> torch.Tensor:
    idx = _ZERO_IDX.get(device)
    if idx is None:
        idx = torch.zeros(1, dtype=torch.int64, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ZERO_IDX[device] = idx
    return idx


def _round_code(round_to: torch.dtype | None, acc: torch.dtype) -> int:
    code = _ROUND_CODES.get(round_to)
    if code is None:
        raise ValueError(f"rows_matmul: round_to must be None, float32, bfloat16 or float16, got {round_to}")
    return 0 if code == 1 and acc == torch.float32 else code


def _launch(
    x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, stride_idx: int, stride_we: int, round_to
) -> torch.Tensor:
    # (one pass over the operands: the mode's eager steps are host-bound, ~100 of these launches each)
    acc = x.dtype
    if acc not in _ACC:
        raise ValueError(f"rows_matmul: x must be float64 or float32 (the accumulator dtype), got {acc}")
    code = _round_code(round_to, acc)
    if w.stride(-1) != 1:
        w = w.contiguous()  # (the same values, so the same bits)
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    n = w.shape[-2]
    out = torch.empty((m, n), dtype=acc, device=x.device)  # (x's dtype is the accumulator's)
    if m == 0 or n == 0:
        return out
    bn, bk = (WIDE_BLOCK_N, WIDE_BLOCK_K) if n >= WIDE_N else (BLOCK_N, BLOCK_K)
    _ROWS(
        (m, -(-n // bn)), (x, w, idx, out), (m, n, k, k, stride_idx, stride_we, w.stride(-2), n),
        ACC=_ACC[acc], BN=bn, BK=bk, ROUND=code,
    )  # fmt: skip
    return out


def rows_matmul(x: torch.Tensor, weight: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    """`x @ weight.T` for `x` [M, K] (FP64 or FP32: the accumulator and output dtype) and `weight` [N, K]
    (any float dtype, K contiguous; widened in the kernel), each row independent of M. `round_to` (FP32,
    BF16 or FP16): every output value rounded to it as the kernel stores it, bit for bit
    `rows_matmul(x, weight).to(round_to).to(x.dtype)` without the two extra kernels."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"rows_matmul: x [M, K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    return _launch(x, weight, _zero_idx(x.device), 0, 0, round_to)


def pair_rows_matmul(
    x: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, round_to: torch.dtype | None = None
) -> torch.Tensor:
    """Row p of `x` [P, K] times `w[pairs[p]].T` (`w` [E, N, K], any float dtype), each row as
    `rows_matmul(x[p:p+1], w[pairs[p]], round_to)` computes it (the same kernel)."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or pairs.shape != (x.shape[0],):
        raise ValueError(
            f"pair_rows_matmul: x [P, K], w [E, N, K], pairs [P] expected, got {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(pairs.shape)}"
        )
    w = w if w.stride(-1) == 1 else w.contiguous()
    return _launch(x, w, pairs.to(torch.int64).contiguous(), 1, w.stride(0), round_to)


def tile_bmm(
    a: torch.Tensor, b: torch.Tensor, ia: torch.Tensor | None = None, ib: torch.Tensor | None = None
) -> torch.Tensor:
    """FP64 a[ia[j]] @ b[ib[j]] (a [Na, m, k], b [Nb, k, n]; no indices: a[j] @ b[j]) in one launch, each
    product one program per column block with one fixed order over k: a product's bits depend on its two
    matrices only, for any number of products (cuBLAS picks its kernel from the batch count)."""
    if (
        a.dim() != 3
        or b.dim() != 3
        or a.shape[2] != b.shape[1]
        or a.dtype != torch.float64
        or b.dtype != a.dtype
    ):
        raise ValueError(
            f"tile_bmm: float64 a [Na, m, k] and b [Nb, k, n] expected, got {a.dtype} {tuple(a.shape)}, "
            f"{b.dtype} {tuple(b.shape)}"
        )
    if (ia is None) != (ib is None):
        raise ValueError("tile_bmm: give both index tensors or neither")
    if ia is None and a.shape[0] != b.shape[0]:
        raise ValueError(f"tile_bmm: {a.shape[0]} and {b.shape[0]} matrices without indices")
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    _, m, k = a.shape
    n = b.shape[2]
    count = a.shape[0] if ia is None else ia.shape[0]
    out = torch.empty(count, m, n, dtype=torch.float64, device=a.device)
    if count == 0 or m == 0 or n == 0:
        return out
    if ia is None:
        zero = _zero_idx(a.device)
        ia = ib = zero
        idx_args = (0, 1, 0, 1)
    else:
        ia, ib = ia.to(torch.int64).contiguous(), ib.to(torch.int64).contiguous()
        idx_args = (1, 0, 1, 0)
    grid = (count, -(-n // TILE_N))
    _TILES(
        grid, (a, b, ia, ib, out),
        (count, m, k, n, *idx_args, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1)),
        BM=_pow2(m), BN=TILE_N, BK=TILE_K,
    )  # fmt: skip
    return out


def row_sum_squares(x: torch.Tensor) -> torch.Tensor:
    """FP32 `(x.float() ** 2).sum(-1)` of contiguous-row `x` [M, K], one fixed order per row at any M."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"row_sum_squares: x [M, K] with contiguous rows expected, got {tuple(x.shape)}")
    m, k = x.shape
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _SUMSQ((m,), (x, out), (m, k, x.stride(0)), BK=_sumsq_block(k))
    return out


@functools.cache
def _sumsq_block(k: int) -> int:
    return min(SUMSQ_BLOCK, _pow2(max(k, 16)))
