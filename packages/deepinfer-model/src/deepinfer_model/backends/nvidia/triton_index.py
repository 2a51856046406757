"""The indexer's weighted ReLU scores as one Triton kernel: out[g, t, j] = sum_h w[g, t, h] relu(q[g, t, h] . k[g, j]).

Why: the torch path computes the [tokens, heads, entries] FP32 scores (32 heads: 32x the output), then
ReLU, weighting and the head sum each read and write that tensor again. In a 16k-token prefill of the medium
V4.1 those passes were the largest kernel-time item after attention (~100 ms of the step: a multiply over
32 GB, the head-sum reduction, the copies). Here a program takes BLOCK_T tokens x all heads as the rows of
one tensor-core product against BLOCK_N keys, applies ReLU and the head weights in registers and reduces
over the heads before the only store: the output is written once and nothing of heads x entries size
exists in memory.

Numerics: BF16 operands, FP32 accumulation, FP32 weighting and head sum (the reference's math; the sum
runs in another order, so it agrees to FP32 rounding, not bitwise). Heads and head dim must be powers of
two (Triton block shapes); other shapes are served by the reference. Plain `.py` (Triton reads the source).
"""

import torch
import triton
import triton.language as tl

BLOCK_N = 128  # keys per program
ROWS = 128  # tokens x heads per program (BLOCK_T = ROWS // heads tokens, at least 1)


@triton.jit
def _index_scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    out_ptr,
    n_q,
    n_keys,
    stride_qg,
    stride_qt,
    stride_qh,
    stride_kg,
    stride_kn,
    stride_wg,
    stride_wt,
    stride_og,
    stride_ot,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = j < n_keys
    k = tl.load(
        k_ptr + g * stride_kg + j[:, None].to(tl.int64) * stride_kn + d[None, :],
        mask=key_ok[:, None],
        other=0.0,
    )
    s = tl.dot(q, tl.trans(k))  # [BLOCK_T * H, BLOCK_N] FP32
    w = tl.load(w_ptr + g * stride_wg + tok.to(tl.int64) * stride_wt + head, mask=row_ok, other=0.0)
    s = tl.maximum(s, 0.0) * w[:, None]
    out = tl.sum(tl.reshape(s, (BLOCK_T, H, BLOCK_N)), axis=1)  # [BLOCK_T, BLOCK_N]
    t_out = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tl.store(
        out_ptr + g * stride_og + t_out[:, None].to(tl.int64) * stride_ot + j[None, :],
        out,
        mask=(t_out < n_q)[:, None] & key_ok[None, :],
    )


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports(heads: int, dim: int) -> bool:
    """Block shapes the kernel takes: power-of-two heads (at most ROWS) and head dim (16 .. 256)."""
    return _pow2(heads) and heads <= ROWS and _pow2(dim) and 16 <= dim <= 256


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q [G, T, h, d] bf16, keys [G, n, d] bf16, weights [G, T, h] -> FP32 [G, T, n]."""
    gs, t, h, d = q.shape
    n = keys.shape[1]
    if not supports(h, d) or q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16:
        raise ValueError(
            f"index_scores kernel: bf16 q [G, T, h, d] / keys [G, n, d] with power-of-two h <= {ROWS} and "
            f"d in [16, 256], got q {tuple(q.shape)} {q.dtype}, keys {tuple(keys.shape)} {keys.dtype}"
        )
    out = torch.empty(gs, t, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights.float()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    block_t = max(1, ROWS // h)
    # (not triton.cdiv: a constexpr function, slow on the host)
    grid = (-(-t // block_t), -(-n // BLOCK_N), gs)
    _index_scores_kernel[grid](
        q,
        keys,
        weights,
        out,
        t,
        n,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        keys.stride(0),
        keys.stride(1),
        weights.stride(0),
        weights.stride(1),
        out.stride(0),
        out.stride(1),
        H=h,
        D=d,
        BLOCK_T=block_t,
        BLOCK_N=BLOCK_N,
        num_warps=8,
    )
    return out
