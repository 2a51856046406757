"""The mHC mixes after their projection as one Triton kernel: row norm, sigmoids, softmax and Sinkhorn.

Why: on the H200 the TileLang epilogue (`tilelang_mhc.py`) runs one thread per token through every
Sinkhorn iteration serially, 22.7 us per call even for one token; with 12 calls per medium decode step
that was 0.27 of its 2.9 ms of kernel time, the largest item after the expert GEMMs. Here one program per
token holds its `m x m` mixing matrix as a tile: each normalisation is a tile reduction and a divide
across the lanes, so a call costs a few microseconds, and the trunk's row norm (torch: a squared copy of
the trunk, a mean and an rsqrt, three launches) is read in the same program.

A prefill's trunk, held in BF16 in native mode (`ShiftedHC`), is projected by `_project_kernel` instead of
cuBLAS: one pass over the 16-bit trunk gives the projection and each row's sum of squares (the GEMM read a
widened FP32 copy, which had to be made first, and the row norm read it again: ~0.8 ms per call at 16k
tokens of the medium V4.1 on the H200, 12 calls per step). Its products are exact on the tensor cores (a
BF16 trunk value times a BF16 part of fn, or an FP16 one times a TF32 part), summed in FP32 chunk by chunk.

Numerics: FP32, the TileLang kernel's formulas (`pre = sigmoid(z * rstd * scale0 + base) + eps`,
`post = 2 sigmoid(...)`, softmax then column / row normalisation with eps in every denominator, IEEE
divides and square root); the row norm sums in another order than torch, so results agree to FP32
rounding, not bitwise. Every step is row-local (one program per token, a fixed order), but batch-invariant
mode keeps its own path (`backends/nvidia/__init__.py`). Plain `.py` (Triton reads the source).
"""

import torch
import triton
import triton.language as tl

from ...numerics import derived_weight

BLOCK_K = 1024  # trunk values per load of the row-norm loop

# A 16-bit trunk of at least this many tokens (prefill) is projected by `_project_kernel`: it reads the trunk
# once, as stored, for the projection and the row norm. Fewer tokens (decode) keep cuBLAS's FP32 GEMM on the
# widened trunk, whose split-K spreads a few rows over the whole GPU.
PROJECT_MIN_TOKENS = 512
PROJECT_BLOCK_T = 64  # tokens per program: each program streams all of fn (3 x 24 x 16k FP32 at the medium
# size) through L2 once, so fewer, taller programs (32 tokens: 1 ms per 16k-token call on the H200, fn's
# re-reads the bound) cut that traffic; 64 still gives two programs per SM at 16k tokens
PROJECT_BLOCK_K = 64  # trunk columns per chunk: the tensor cores' partial sum of one chunk is added to the
# running sum on the CUDA cores


@triton.jit
def _project_kernel(
    x_ptr,  # [T, K] 16-bit flattened trunk
    f_ptr,  # [3, N, K] fn as three parts, fn = hi + mid + lo exactly: BF16 parts (a BF16 trunk) or FP32
    # parts that are exact TF32 values (an FP16 trunk)
    z_ptr,  # [T, N] FP32 out: x @ fn.T
    ss_ptr,  # [T] FP32 out: the row's sum of squares
    w_ptr,  # [T, M] FP32 read weights (READ)
    r_ptr,  # [T, H] out (READ): sum_i w[t, i] * trunk[t, i] in FP32, rounded once to its dtype
    T,
    H,
    one,  # 1.0 at run time (see the chunk sum below)
    M: tl.constexpr,  # streams: the flat row is M * H long, stream i at columns i * H ..
    READ: tl.constexpr,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # A BF16 trunk meets fn's BF16 parts in BF16 products (half the bytes of fn and twice the TF32 rate); an
    # FP16 value is an exact TF32 value and so is each TF32 part of fn: either way every product is exact.
    # Their sums are not: the tensor cores add a product to the accumulator by aligning it to the larger
    # exponent and dropping the bits below (truncation, not rounding). Fed the running sum of all of K, that
    # bias has one sign for the whole row and grows with K (relative error 8e-5 at K = 16k on the H200, an
    # FP32 GEMM's is ~1e-7). So each chunk of BLOCK_K columns is summed from zero on the tensor cores (its
    # small bias has the chunk's own sign) and added to the running sum in rounded FP32 on the CUDA cores.
    # The product by `one`, a run-time value, keeps the compiler from folding that add back into the dot.
    # Columns go stream by stream within each block of H, so the read of the same trunk (READ: the sub-layer
    # input under the previous pre mix) is summed over the streams from the values already loaded.
    K = M * H
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    for h0 in range(0, H, BLOCK_K):
        hh = h0 + tl.arange(0, BLOCK_K)
        h_ok = hh < H
        read = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for i in tl.static_range(M):
            kk = i * H + hh
            x_off = rows.to(tl.int64)[:, None] * K + kk[None, :]
            x16 = tl.load(x_ptr + x_off, mask=r_ok[:, None] & h_ok[None, :], other=0.0)
            x = x16.to(tl.float32)
            ss += tl.sum(x * x, 1)
            if READ:
                read += tl.load(w_ptr + rows * M + i, mask=r_ok, other=0.0)[:, None] * x
            f_off = n[:, None] * K + kk[None, :]
            f_ok = n_ok[:, None] & h_ok[None, :]
            part = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            for p in tl.static_range(3):  # lo, mid, then hi: the small parts first
                f = tl.load(f_ptr + (2 - p) * N * K + f_off, mask=f_ok, other=0.0)
                if f_ptr.dtype.element_ty == tl.bfloat16:
                    part = tl.dot(x16, tl.trans(f), part)
                else:
                    part = tl.dot(x, tl.trans(f), part, input_precision="tf32")
            acc += part * one
        if READ:
            r_off = rows.to(tl.int64)[:, None] * H + hh[None, :]
            tl.store(r_ptr + r_off, read.to(r_ptr.dtype.element_ty), mask=r_ok[:, None] & h_ok[None, :])
    tl.store(z_ptr + rows.to(tl.int64)[:, None] * N + n[None, :], acc, mask=r_ok[:, None] & n_ok[None, :])
    tl.store(ss_ptr + rows, ss, mask=r_ok)


def _tf32_trunc(x: torch.Tensor) -> torch.Tensor:
    """FP32 `x` with the 13 low mantissa bits cleared: an exact TF32 value (truncated toward zero)."""
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


def tf32_parts(fn: torch.Tensor) -> torch.Tensor:
    """[3, N, K] FP32 (hi, mid, lo), each an exact TF32 value, with hi + mid + lo == fn exactly (FP32 has 24
    significant bits, TF32 11: truncating twice leaves a rest of at most 2 bits)."""
    f = fn.float()
    hi = _tf32_trunc(f)
    rest = f - hi  # exact: the low 13 bits of f
    mid = _tf32_trunc(rest)
    return torch.stack((hi, mid, rest - mid)).contiguous()


def bf16_parts(fn: torch.Tensor) -> torch.Tensor:
    """[3, N, K] BF16 (hi, mid, lo) with hi + mid + lo == fn exactly: each part is the rest rounded to BF16
    (8 significant bits; the rest after a rounding is exact in FP32 and has at most 16, then 8, bits left)."""
    f = fn.float()
    hi = f.bfloat16()
    rest = f - hi.float()
    mid = rest.bfloat16()
    return torch.stack((hi, mid, (rest - mid.float()).bfloat16())).contiguous()


def project_pipelining(trunk_dtype: torch.dtype) -> dict:
    """`_project_kernel`'s launch options for a trunk of this dtype. FP32 parts (an FP16 trunk), software-
    pipelined, ask for 360 KB of shared memory at the default launch on the H200 (227 KB there): unpipelined,
    8 KB. BF16 parts fit pipelined (12 KB)."""
    return {} if trunk_dtype == torch.bfloat16 else {"num_stages": 1}


def project(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    block_t: int = PROJECT_BLOCK_T,
    num_warps: int = 4,
    block_k: int = PROJECT_BLOCK_K,
    read_weights: torch.Tensor | None = None,
    read_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z = flat(trunk) @ fn.T [T, N] FP32, sum of squares of each flat row [T] FP32) of a 16-bit trunk
    [T, m, H]; with `read_weights` [T, m] also the read `sum_i w[:, i] * trunk[:, i]` [T, H] in FP32 rounded
    once to `read_dtype` (16-bit or FP32), from the same pass (`block_t`, `num_warps`, `block_k`: the launch,
    for `bench_mhc_mixes.py`'s sweep)."""
    t, m, h = trunk.shape
    flat = trunk if trunk.is_contiguous() else trunk.contiguous()
    n = fn.shape[0]
    z = torch.empty(t, n, dtype=torch.float32, device=trunk.device)
    ss = torch.empty(t, dtype=torch.float32, device=trunk.device)
    reading = read_weights is not None
    read = torch.empty(t, h, dtype=read_dtype or trunk.dtype, device=trunk.device) if reading else ss
    weights = read_weights.float().contiguous() if reading else ss
    if trunk.dtype == torch.bfloat16:
        parts = derived_weight(fn, "bf16_parts", bf16_parts)
    else:
        parts = derived_weight(fn, "tf32_parts", tf32_parts)
    if t:
        _project_kernel[(-(-t // block_t),)](
            flat, parts, z, ss, weights, read, t, h, 1.0,
            M=m, READ=reading, N=n, BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_T=block_t,
            BLOCK_K=block_k, num_warps=num_warps, **project_pipelining(trunk.dtype),
        )  # fmt: skip
    return (z, ss, read) if reading else (z, ss)


def _projects(trunk: torch.Tensor) -> bool:
    """Whether `_project_kernel` projects `trunk`: a 16-bit prefill trunk [T >= `PROJECT_MIN_TOKENS`, m, H]."""
    return (
        trunk.dtype in (torch.bfloat16, torch.float16)
        and trunk.dim() == 3
        and trunk.shape[0] >= PROJECT_MIN_TOKENS
    )


def fuses_read(trunk: torch.Tensor, read_dtype: torch.dtype) -> bool:
    """Whether `hc_mixes_read` projects and reads `trunk` in one pass: a trunk `_project_kernel` projects,
    read into a 16-bit or FP32 output."""
    return _projects(trunk) and read_dtype in (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _mixes_kernel(
    z_ptr,
    x_ptr,
    ss_ptr,
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
    SS_GIVEN: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    # rstd of the token's flattened trunk row (x: [T, m * H] FP32), or from its sum of squares (ss: [T])
    if SS_GIVEN:
        total = tl.load(ss_ptr + t)
    else:
        acc = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, n_k, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + t * n_k + kk, mask=kk < n_k, other=0.0)
            acc += v * v
        total = tl.sum(acc, 0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(total / n_k + rms_eps))

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
    """(pre [T, m], post [T, m], comb [T, m, m]) FP32 of trunk [T, m, H]: the projection `z = flat(trunk) @
    fn.T` in FP32 - `_project_kernel` for a 16-bit trunk of at least `PROJECT_MIN_TOKENS` tokens, else
    cuBLAS's FP32 GEMM (TF32 off) on the widened trunk - then the kernel. The op registry's `hc_mixes`
    contract."""
    if iters < 1:
        raise ValueError(f"hc_mixes: iters must be >= 1, got {iters}")
    if _projects(trunk):
        z, ss = project(trunk, fn)
        return _epilogue(trunk, z, None, ss, base, scale, hc_eps, rms_eps, iters)
    flat = trunk.float().flatten(1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    z = flat @ fn.float().t()
    z = z if z.is_contiguous() else z.contiguous()
    return _epilogue(trunk, z, flat, None, base, scale, hc_eps, rms_eps, iters)


def hc_mixes_read(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    rms_eps: float,
    iters: int,
    read_weights: torch.Tensor,
    read_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registry's `hc_mixes_read` for trunks `fuses_read` takes: `hc_mixes`'s outputs and the read under
    `read_weights`, the trunk read once for both (a prefill's 16-bit trunk: 0.5 GB per sub-layer at 16k
    tokens of the medium V4.1, which the separate read kernel read again)."""
    if iters < 1:
        raise ValueError(f"hc_mixes_read: iters must be >= 1, got {iters}")
    if not fuses_read(trunk, read_dtype):
        raise ValueError(
            f"hc_mixes_read (Triton): a 16-bit trunk [T >= {PROJECT_MIN_TOKENS}, m, H] and a 16-bit / FP32 read, "
            f"got {trunk.dtype} {tuple(trunk.shape)}, {read_dtype}"
        )
    z, ss, read = project(trunk, fn, read_weights=read_weights, read_dtype=read_dtype)
    return (*_epilogue(trunk, z, None, ss, base, scale, hc_eps, rms_eps, iters), read)


def _epilogue(trunk, z, flat, ss, base, scale, hc_eps, rms_eps, iters):
    """`_mixes_kernel` over the projection `z` (the row norm from `ss`, or from `flat`, the widened trunk)."""
    t, m = trunk.shape[0], trunk.shape[1]
    n_k = trunk.shape[1] * trunk.shape[2]
    pre = torch.empty(t, m, dtype=torch.float32, device=trunk.device)
    post = torch.empty(t, m, dtype=torch.float32, device=trunk.device)
    comb = torch.empty(t, m, m, dtype=torch.float32, device=trunk.device)
    if t:
        _mixes_kernel[(t,)](
            z,
            z if flat is None else flat,
            z if ss is None else ss,
            scale.float().contiguous(),
            base.float().contiguous(),
            pre,
            post,
            comb,
            n_k,
            float(rms_eps),
            float(hc_eps),
            M=m,
            MP=triton.next_power_of_2(m),
            ITERS=int(iters),
            BLOCK_K=min(BLOCK_K, triton.next_power_of_2(n_k)),
            SS_GIVEN=ss is not None,
            num_warps=4,
        )
    return pre, post, comb
