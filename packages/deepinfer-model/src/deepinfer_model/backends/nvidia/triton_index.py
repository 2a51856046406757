"""The indexer's weighted ReLU scores as one Triton kernel: out[g, t, j] = sum_h w[g, t, h] relu(q[g, t, h] . k[g, j]).

Why: the torch path computes the [tokens, heads, entries] FP32 scores (32 heads: 32x the output), then
ReLU, weighting and the head sum each read and write that tensor again. In a 16k-token prefill of the medium
V4.1 those passes were the largest kernel-time item after attention (~100 ms of the step: a multiply over
32 GB, the head-sum reduction, the copies). Here a program takes BLOCK_T tokens x all heads (one tile, loaded
once) and loops over blocks of BLOCK_N keys: one tensor-core product per key block, ReLU and the head weights
in registers, the head sum before the only store. Nothing of heads x entries size exists in memory.

Causal bound (`limit`): entry j of row t is visible iff j < limit[g, t] (a prefill query at position p sees
the entries of complete blocks, j < (p + 1) // ratio). A program's key loop ends at its rows' largest
limit; the invisible rest of its key range is stored as zeros (no loads, no products): in a prefill chunk
about half the rectangle. Invisible elements of computed blocks are zero too, so the output is a function of
the inputs alone.

Tile shape (`CONFIGS`, one picked by `config`): `rows` = tokens x heads of the query tile (BLOCK_T = rows //
heads tokens), `block_n` keys per product, `keys_major` which operand is the product's M side: keys (the
head sum then runs over the product's columns, within threads and over 4 lanes) or tokens x heads (over its
rows, across warps), `num_warps`, `num_stages` (the key loads' pipeline depth), optionally
`keys_per_program` (a fixed key range per program; "legacy": one block). The grid is (row blocks, key
splits, G), heaviest row blocks (largest limits) first; the keys are split only when the row blocks alone
would leave the GPU idle (decode: one token per sequence), so a prefill program reads its query tile once.

Numerics: 16-bit operands (BF16; FP16 too, for Triton's interpreter, whose BF16 `tl.dot` is wrong), FP32
accumulation, FP32 weighting and head sum (the reference's math; the sum runs in another order, so it agrees
to FP32 rounding, not bitwise). `out_dtype` BF16 / FP16: the FP32 sums rounded to nearest even in the kernel
(`.to()`, as torch's cast: the same bits as rounding the FP32 output afterwards). Heads and head dim must be
powers of two (Triton block shapes); other shapes are served by the reference. Plain `.py` (Triton reads the
source).
"""

import functools

import torch
import triton
import triton.language as tl

ROWS = 128  # the largest head count `supports` takes (one token's heads fill a 128-row tile)

# Candidate tile configurations (`benchmarks/gpu/bench_index_scores.py` times each on the medium V4.1's
# shapes). "legacy" is the previous kernel's tile: one 128-row x 128-key product per program, no key loop.
# Measured on an H100 (T = 8192 rows, 32 heads of 128; benchmarks/results/bench_index_scores.json): keys as
# the M side beat tokens x heads by 1.7x (the head sum stays within a warp), the key loop alone gave 2.4x over
# "legacy". "k256_n64" was within 2.5% of the fastest in all 6 BF16-output cases (within 12% with FP32):
# 1.83 ms for the whole 8192 x 16384 rectangle with BF16 output (82% of an 8192^3 BF16 mm in the same run);
# the four calls of a 16k-token prefill (n = 8k, 16k; causal bounds; BF16 out) 2.98 ms against 26.6 ms for
# "legacy" (FP32, no bounds).
CONFIGS: dict[str, dict] = {
    "legacy": {
        "rows": 128,
        "block_n": 128,
        "keys_major": False,
        "num_warps": 8,
        "num_stages": 3,
        "keys_per_program": 128,
    },
    "r128_n128": {"rows": 128, "block_n": 128, "keys_major": False, "num_warps": 8, "num_stages": 3},
    "k128_n128": {"rows": 128, "block_n": 128, "keys_major": True, "num_warps": 8, "num_stages": 3},
    "k128_n128_w4": {"rows": 128, "block_n": 128, "keys_major": True, "num_warps": 4, "num_stages": 2},
    "k128_n64": {"rows": 128, "block_n": 64, "keys_major": True, "num_warps": 4, "num_stages": 3},
    "k128_n64_s2": {"rows": 128, "block_n": 64, "keys_major": True, "num_warps": 4, "num_stages": 2},
    "k256_n64": {"rows": 256, "block_n": 64, "keys_major": True, "num_warps": 8, "num_stages": 3},
    "k256_n64_s2": {"rows": 256, "block_n": 64, "keys_major": True, "num_warps": 8, "num_stages": 2},
    "k256_n64_s4": {"rows": 256, "block_n": 64, "keys_major": True, "num_warps": 8, "num_stages": 4},
    "k256_n64_w4": {"rows": 256, "block_n": 64, "keys_major": True, "num_warps": 4, "num_stages": 3},
}
DEFAULT_CONFIG = "k256_n64"
# Programs wanted in flight before the keys are split across programs (per multiprocessor)
PROGRAMS_PER_SM = 2


@triton.jit
def _index_scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    lim_ptr,
    out_ptr,
    n_q,
    n_keys,
    keys_per_split,
    stride_qg,
    stride_qt,
    stride_qh,
    stride_kg,
    stride_kn,
    stride_wg,
    stride_wt,
    stride_lg,
    stride_lt,
    stride_og,
    stride_ot,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    KEYS_MAJOR: tl.constexpr,
):
    # heaviest row blocks first (with causal limits the last tokens see the most keys)
    pid_t = tl.num_programs(0) - 1 - tl.program_id(0)
    g = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, BLOCK_T * H)  # row = token * H + head
    tok = pid_t * BLOCK_T + r // H
    head = r % H
    d = tl.arange(0, D)
    row_ok = tok < n_q
    q = tl.load(
        q_ptr
        + g * stride_qg
        + tok[:, None].to(tl.int64) * stride_qt
        + head[:, None] * stride_qh
        + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    w = tl.load(w_ptr + g * stride_wg + tok.to(tl.int64) * stride_wt + head, mask=row_ok, other=0.0)
    t_out = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t_out < n_q
    lo = tl.program_id(1) * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_keys)
    end = hi  # keys [lo, end) are computed, [end, hi) stored as zeros
    if HAS_LIMIT:
        lim = tl.load(lim_ptr + g * stride_lg + t_out.to(tl.int64) * stride_lt, mask=t_ok, other=0)
        lim = tl.minimum(tl.maximum(lim, 0), n_keys).to(tl.int32)
        end = tl.maximum(tl.minimum(hi, tl.max(lim, axis=0)), lo)
    o_base = out_ptr + g * stride_og
    for j0 in range(lo, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        key_ok = j < n_keys
        k = tl.load(
            k_ptr + g * stride_kg + j[:, None].to(tl.int64) * stride_kn + d[None, :],
            mask=key_ok[:, None],
            other=0.0,
        )
        if KEYS_MAJOR:
            s = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_T * H] FP32: the head sum runs along the columns
            s = tl.maximum(s, 0.0) * w[None, :]
            o = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_T, H)), axis=2)  # [BLOCK_N, BLOCK_T]
            ok = key_ok[:, None] & t_ok[None, :]
            if HAS_LIMIT:
                o = tl.where(j[:, None] < lim[None, :], o, 0.0)
            ptrs = o_base + t_out[None, :].to(tl.int64) * stride_ot + j[:, None]
        else:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_T * H, BLOCK_N] FP32: the head sum runs along the rows
            s = tl.maximum(s, 0.0) * w[:, None]
            o = tl.sum(tl.reshape(s, (BLOCK_T, H, BLOCK_N)), axis=1)  # [BLOCK_T, BLOCK_N]
            ok = t_ok[:, None] & key_ok[None, :]
            if HAS_LIMIT:
                o = tl.where(j[None, :] < lim[:, None], o, 0.0)
            ptrs = o_base + t_out[:, None].to(tl.int64) * stride_ot + j[None, :]
        tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=ok)
    if HAS_LIMIT:  # key blocks past every row's limit: zeros, no loads or products
        zero = tl.zeros((BLOCK_T, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        first = lo + tl.cdiv(end - lo, BLOCK_N) * BLOCK_N
        for j0 in range(first, hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            ptrs = o_base + t_out[:, None].to(tl.int64) * stride_ot + j[None, :]
            tl.store(ptrs, zero, mask=t_ok[:, None] & (j < n_keys)[None, :])


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports(heads: int, dim: int) -> bool:
    """Block shapes the kernel takes: power-of-two heads (at most ROWS) and head dim (16 .. 256)."""
    return _pow2(heads) and heads <= ROWS and _pow2(dim) and 16 <= dim <= 256


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # (Triton's interpreter: as an H200)
    return torch.cuda.get_device_properties(device).multi_processor_count


_OPERANDS = (torch.bfloat16, torch.float16)
_OUTPUTS = (torch.float32, torch.bfloat16, torch.float16)


def index_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    limit: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    config: str | dict | None = None,
) -> torch.Tensor:
    """q [G, T, h, d] bf16 (or fp16), keys [G, n, d] of q's dtype, weights [G, T, h], limit int [G, T] or None
    -> out_dtype (FP32 default, BF16, FP16) [G, T, n]; entries j >= limit[g, t] are 0. `config`: a `CONFIGS`
    name or dict (the bench's sweep); `DEFAULT_CONFIG` else."""
    gs, t, h, d = q.shape
    n = keys.shape[1]
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    if not supports(h, d) or q.dtype not in _OPERANDS or keys.dtype != q.dtype or out_dtype not in _OUTPUTS:
        raise ValueError(
            f"index_scores kernel: bf16 / fp16 q [G, T, h, d] and keys [G, n, d] with power-of-two h <= "
            f"{ROWS} and d in [16, 256], output one of {_OUTPUTS}; got q {tuple(q.shape)} {q.dtype}, keys "
            f"{tuple(keys.shape)} {keys.dtype}, out_dtype {out_dtype}"
        )
    if limit is not None and (limit.shape != (gs, t) or limit.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"index_scores: limit must be int32 / int64 [G, T] = {(gs, t)}, got {limit.shape}")
    out = torch.empty(gs, t, n, dtype=out_dtype, device=q.device)
    if out.numel() == 0:
        return out
    cfg = CONFIGS[config or DEFAULT_CONFIG] if not isinstance(config, dict) else config
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights.float()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    block_t = max(1, cfg["rows"] // h)
    block_n = cfg["block_n"]
    # (not triton.cdiv: a constexpr function, slow on the host)
    row_blocks = -(-t // block_t)
    key_blocks = -(-n // block_n)
    per_split = cfg.get("keys_per_program")
    if per_split is None:  # split the keys only as far as the row blocks leave programs wanting
        wanted = PROGRAMS_PER_SM * _multiprocessors(q.device)
        splits = min(key_blocks, max(1, -(-wanted // (row_blocks * gs))))
        per_split = -(-key_blocks // splits) * block_n
    elif per_split <= 0 or per_split % block_n:
        raise ValueError(f"index_scores: keys_per_program must be a positive multiple of block_n, got {cfg}")
    splits = -(-n // per_split)
    lim = limit if limit is not None else out  # (an unused pointer)
    _index_scores_kernel[(row_blocks, splits, gs)](
        q,
        keys,
        weights,
        lim,
        out,
        t,
        n,
        per_split,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        keys.stride(0),
        keys.stride(1),
        weights.stride(0),
        weights.stride(1),
        lim.stride(0) if limit is not None else 0,
        lim.stride(1) if limit is not None else 0,
        out.stride(0),
        out.stride(1),
        H=h,
        D=d,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        HAS_LIMIT=limit is not None,
        KEYS_MAJOR=bool(cfg["keys_major"]),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
