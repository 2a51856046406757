"""mHC stream read / write and the mixes epilogue as TileLang kernels (SM90), FP32 math.

* `hc_read`: `y[t] = sum_i w[t, i] * R[t, i]`, one CTA per (token, channel block).
* `hc_write`: `R'[t, j] = post[t, j] * y[t] + sum_i comb[t, i, j] * R[t, i]`, same grid.
* `hc_mixes`: the `[T, mH] x [mH, (2+m)m]` projection and the row norms stay cuBLAS FP32 GEMMs (TF32 off;
  in batch-invariant mode the Triton row kernels of `triton_rows.py`, whose rows do not depend on T; with
  Triton absent or `DEEPINFER_TRITON=0` the mode's mixes are the reference's, as its GEMM ops are);
  everything after them - scaling, sigmoids, the row softmax and all Sinkhorn iterations, ~4 + 2*iters
  small torch launches - is one kernel with one thread per token.
Compiled per (m, H or iters, dtypes); the token count is dynamic. Plain `.py` (TileLang reads the source).
"""

# No `from __future__ import annotations` here: TileLang evaluates the kernel's string annotations
# with only the names its body uses in scope, so a shape or dtype named only in an annotation
# (e.g. the input dtype) raised NameError on the GPU. Eager annotations avoid that.

import functools

import tilelang
import tilelang.language as T
import torch

from ... import batch_invariant

_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_THREADS = 128


def _block(hidden: int) -> int:
    for b in (1024, 512, 256, 128, 64, 32):
        if hidden % b == 0:
            return b
    raise ValueError(f"mHC kernels need the hidden size to be a multiple of 32, got {hidden}")


def _read_program(m: int, hidden: int, in_dtype: str, out_dtype: str):
    tokens, block = T.dynamic("tokens"), _block(hidden)

    @T.prim_func
    def hc_read_k(
        trunk: T.Tensor((tokens, m, hidden), in_dtype),
        w: T.Tensor((tokens, m), "float32"),
        y: T.Tensor((tokens, hidden), out_dtype),
    ):
        with T.Kernel(hidden // block, tokens, threads=min(_THREADS, block)) as (bx, t):
            acc = T.alloc_fragment((block,), "float32")
            T.clear(acc)
            for i in T.serial(m):
                for j in T.Parallel(block):
                    acc[j] += w[t, i] * T.cast(trunk[t, i, bx * block + j], "float32")
            for j in T.Parallel(block):
                y[t, bx * block + j] = T.cast(acc[j], out_dtype)

    return hc_read_k


def _write_program(m: int, hidden: int, in_dtype: str, y_dtype: str, out_dtype: str):
    tokens, block = T.dynamic("tokens"), _block(hidden)

    @T.prim_func
    def hc_write_k(
        y: T.Tensor((tokens, hidden), y_dtype),
        trunk: T.Tensor((tokens, m, hidden), in_dtype),
        post: T.Tensor((tokens, m), "float32"),
        comb: T.Tensor((tokens, m, m), "float32"),
        out: T.Tensor((tokens, m, hidden), out_dtype),
    ):
        with T.Kernel(hidden // block, tokens, threads=min(_THREADS, block)) as (bx, t):
            acc = T.alloc_fragment((block,), "float32")
            for s in T.serial(m):
                T.clear(acc)
                for i in T.serial(m):
                    for j in T.Parallel(block):
                        acc[j] += comb[t, i, s] * T.cast(trunk[t, i, bx * block + j], "float32")
                for j in T.Parallel(block):
                    out[t, s, bx * block + j] = T.cast(
                        post[t, s] * T.cast(y[t, bx * block + j], "float32") + acc[j], out_dtype
                    )

    return hc_write_k


def _mixes_program(m: int, iters: int, hc_eps: float):
    tokens, n = T.dynamic("tokens"), (2 + m) * m

    @T.prim_func
    def hc_mixes_k(
        z: T.Tensor((tokens, n), "float32"),
        rstd: T.Tensor((tokens,), "float32"),
        scale: T.Tensor((3,), "float32"),
        base: T.Tensor((n,), "float32"),
        pre: T.Tensor((tokens, m), "float32"),
        post: T.Tensor((tokens, m), "float32"),
        comb: T.Tensor((tokens, m, m), "float32"),
    ):
        with T.Kernel(T.ceildiv(tokens, _THREADS), threads=_THREADS) as bx:
            tx = T.get_thread_binding()
            c = T.alloc_local((m * m,), "float32")
            acc = T.alloc_local((1,), "float32")
            t = bx * _THREADS + tx
            if t < tokens:
                for i in T.serial(m):
                    pre[t, i] = 1.0 / (1.0 + T.exp(-(z[t, i] * rstd[t] * scale[0] + base[i]))) + hc_eps
                    post[t, i] = 2.0 / (1.0 + T.exp(-(z[t, m + i] * rstd[t] * scale[1] + base[m + i])))
                for k in T.serial(m * m):
                    c[k] = z[t, 2 * m + k] * rstd[t] * scale[2] + base[2 * m + k]
                for i in T.serial(m):  # row softmax (+ eps)
                    acc[0] = c[i * m]
                    for j in T.serial(m):
                        acc[0] = T.max(acc[0], c[i * m + j])
                    for j in T.serial(m):
                        c[i * m + j] = T.exp(c[i * m + j] - acc[0])
                    acc[0] = 0.0
                    for j in T.serial(m):
                        acc[0] = acc[0] + c[i * m + j]
                    for j in T.serial(m):
                        c[i * m + j] = c[i * m + j] / acc[0] + hc_eps
                for it in T.serial(2 * iters - 1):  # column normalisation first, then row / column
                    if it % 2 == 0:
                        for j in T.serial(m):
                            acc[0] = 0.0
                            for i in T.serial(m):
                                acc[0] = acc[0] + c[i * m + j]
                            for i in T.serial(m):
                                c[i * m + j] = c[i * m + j] / (acc[0] + hc_eps)
                    else:
                        for i in T.serial(m):
                            acc[0] = 0.0
                            for j in T.serial(m):
                                acc[0] = acc[0] + c[i * m + j]
                            for j in T.serial(m):
                                c[i * m + j] = c[i * m + j] / (acc[0] + hc_eps)
                for k in T.serial(m * m):
                    comb[t, k // m, k % m] = c[k]

    return hc_mixes_k


@functools.cache
def _read_kernel(*key):
    return tilelang.compile(_read_program(*key), target="cuda")


@functools.cache
def _write_kernel(*key):
    return tilelang.compile(_write_program(*key), target="cuda")


@functools.cache
def _mixes_kernel(*key):
    return tilelang.compile(_mixes_program(*key), target="cuda")


def _carrier(x: torch.Tensor, name: str) -> torch.Tensor:
    """BF16 / FP32 as is; FP64 (the model's carrier of rounded values) read as FP32."""
    if x.dtype == torch.float64:
        x = x.float()
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be bfloat16, float32 or float64, got {x.dtype}")
    return x.contiguous()


def _out_dtype(out_dtype: torch.dtype | None, like: torch.dtype) -> torch.dtype:
    out = out_dtype or like
    if out not in _DTYPES:
        raise ValueError(f"mHC output dtype must be bfloat16 or float32, got {out}")
    return out


def hc_read(trunk: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    out_dtype = _out_dtype(out_dtype, trunk.dtype)
    r = _carrier(trunk, "trunk")
    t, m, h = r.shape
    y = torch.empty(t, h, dtype=out_dtype, device=r.device)
    if t:
        _read_kernel(m, h, _DTYPES[r.dtype], _DTYPES[out_dtype])(r, weights.float().contiguous(), y)
    return y


def hc_write(
    y: torch.Tensor,
    trunk: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out_dtype = _out_dtype(out_dtype, trunk.dtype)
    r, yy = _carrier(trunk, "trunk"), _carrier(y, "y")
    t, m, h = r.shape
    out = torch.empty(t, m, h, dtype=out_dtype, device=r.device)
    if t:
        kernel = _write_kernel(m, h, _DTYPES[r.dtype], _DTYPES[yy.dtype], _DTYPES[out_dtype])
        kernel(yy, r, post.float().contiguous(), comb.float().contiguous(), out)
    return out


def hc_mixes(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    rms_eps: float,
    iters: int,
    *,
    triton_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`triton_rows`: batch-invariant mode projects through the Triton row kernels; False (the table built
    without Triton: `DEEPINFER_TRITON=0` or no `triton`), that mode's mixes are the reference's, as its
    GEMM ops are."""
    if iters < 1:
        raise ValueError(f"hc_mixes: iters must be >= 1, got {iters}")
    if batch_invariant.enabled() and not triton_rows:
        from .. import cpu as reference

        return reference.hc_mixes(trunk, fn, base, scale, hc_eps, rms_eps, iters)
    t, m = trunk.shape[0], trunk.shape[1]
    flat = trunk.float().flatten(1).contiguous()
    if batch_invariant.enabled():
        # cuBLAS and torch's reductions pick their split from the token count: the row kernels do not
        from . import triton_rows

        rstd = torch.rsqrt(triton_rows.row_sum_squares(flat) / flat.shape[1] + rms_eps)
        z = triton_rows.rows_matmul(flat, fn)
    else:
        rstd = torch.rsqrt(flat.square().mean(-1) + rms_eps).contiguous()
        z = (flat @ fn.float().t()).contiguous()  # FP32 GEMM (torch keeps TF32 off unless asked)
    pre = torch.empty(t, m, dtype=torch.float32, device=trunk.device)
    post, comb = torch.empty_like(pre), torch.empty(t, m, m, dtype=torch.float32, device=trunk.device)
    if t:
        _mixes_kernel(m, int(iters), float(hc_eps))(
            z, rstd, scale.float().contiguous(), base.float().contiguous(), pre, post, comb
        )
    return pre, post, comb
