"""The mHC mixes after their projection as one Triton kernel: row norm, sigmoids, softmax and Sinkhorn.

Why: on the H200 the TileLang epilogue (`tilelang_mhc.py`) runs one thread per token through every
Sinkhorn iteration serially, 22.7 us per call even for one token; with 12 calls per medium decode step
that was 0.27 of its 2.9 ms of kernel time, the largest item after the expert GEMMs. Here one program per
token holds its `m x m` mixing matrix as a tile: each normalisation is a tile reduction and a divide
across the lanes, so a call costs a few microseconds, and the trunk's row norm (torch: a squared copy of
the trunk, a mean and an rsqrt, three launches) is read in the same program.

Numerics: FP32, the TileLang kernel's formulas (`pre = sigmoid(z * rstd * scale0 + base) + eps`,
`post = 2 sigmoid(...)`, softmax then column / row normalisation with eps in every denominator, IEEE
divides and square root); the row norm sums in another order than torch, so results agree to FP32
rounding, not bitwise. Every step is row-local (one program per token, a fixed order), but batch-invariant
mode keeps its own path (`backends/nvidia/__init__.py`). Plain `.py` (Triton reads the source).
"""

import torch
import triton
import triton.language as tl

BLOCK_K = 1024  # trunk values per load of the row-norm loop


@triton.jit
def _mixes_kernel(
    z_ptr,
    x_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    n_k,
    rms_eps,
    hc_eps,
    M: tl.constexpr,
    MP: tl.constexpr,
    ITERS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    # rstd of the token's flattened trunk row (x: [T, m * H] FP32)
    acc = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, n_k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + t * n_k + kk, mask=kk < n_k, other=0.0)
        acc += v * v
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(acc, 0) / n_k + rms_eps))

    n_z: tl.constexpr = (2 + M) * M
    z_row = z_ptr + t * n_z
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    i = tl.arange(0, MP)
    ok = i < M
    a = tl.load(z_row + i, mask=ok, other=0.0) * rstd * s_pre + tl.load(base_ptr + i, mask=ok, other=0.0)
    pre = tl.div_rn(1.0, 1.0 + tl.exp(-a)) + hc_eps
    b = tl.load(z_row + M + i, mask=ok, other=0.0) * rstd * s_post + tl.load(
        base_ptr + M + i, mask=ok, other=0.0
    )
    post = tl.div_rn(2.0, 1.0 + tl.exp(-b))
    tl.store(pre_ptr + t * M + i, pre, mask=ok)
    tl.store(post_ptr + t * M + i, post, mask=ok)

    r = i[:, None]
    c = i[None, :]
    valid = (r < M) & (c < M)
    off = 2 * M + r * M + c
    logit = tl.load(z_row + off, mask=valid, other=0.0) * rstd * s_comb
    logit = logit + tl.load(base_ptr + off, mask=valid, other=0.0)
    logit = tl.where(valid, logit, float("-inf"))
    row_max = tl.max(logit, 1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # (padded rows: no NaN from -inf - -inf)
    e = tl.where(valid, tl.exp(logit - row_max[:, None]), 0.0)
    den = tl.sum(e, 1)
    den = tl.where(den > 0.0, den, 1.0)
    mix = tl.where(valid, tl.div_rn(e, den[:, None]) + hc_eps, 0.0)
    for it in tl.static_range(2 * ITERS - 1):  # column normalisation first, then row / column
        if it % 2 == 0:
            mix = tl.div_rn(mix, tl.sum(mix, 0)[None, :] + hc_eps)
        else:
            mix = tl.div_rn(mix, tl.sum(mix, 1)[:, None] + hc_eps)
    tl.store(comb_ptr + t * M * M + r * M + c, mix, mask=valid)


def hc_mixes(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    rms_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, m], post [T, m], comb [T, m, m]) FP32 of trunk [T, m, H]: the cuBLAS FP32 projection
    `z = flat(trunk) @ fn.T` (TF32 off), then the kernel. The op registry's `hc_mixes` contract."""
    if iters < 1:
        raise ValueError(f"hc_mixes: iters must be >= 1, got {iters}")
    t, m = trunk.shape[0], trunk.shape[1]
    flat = trunk.float().flatten(1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    z = flat @ fn.float().t()
    z = z if z.is_contiguous() else z.contiguous()
    pre = torch.empty(t, m, dtype=torch.float32, device=trunk.device)
    post = torch.empty(t, m, dtype=torch.float32, device=trunk.device)
    comb = torch.empty(t, m, m, dtype=torch.float32, device=trunk.device)
    if t:
        _mixes_kernel[(t,)](
            z,
            flat,
            scale.float().contiguous(),
            base.float().contiguous(),
            pre,
            post,
            comb,
            flat.shape[1],
            float(rms_eps),
            float(hc_eps),
            M=m,
            MP=triton.next_power_of_2(m),
            ITERS=int(iters),
            BLOCK_K=min(BLOCK_K, triton.next_power_of_2(flat.shape[1])),
            num_warps=4,
        )
    return pre, post, comb
