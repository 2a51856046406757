"""RMSNorm as a TileLang kernel (SM90): one CTA per `rows` rows, FP32 statistics, one rounding.

`y = cast(x * rsqrt(mean(x^2) + eps) * w)`: the weight is applied before the single rounding, as the
engine's fused kernel does (spec v41-model 10.4). The row count is symbolic, so one compiled kernel
serves every batch; a kernel is compiled per (hidden size, dtype, eps, weighted).
TileLang reads the kernel function's source, so this must stay a plain `.py` module.
"""

# No `from __future__ import annotations` here: TileLang evaluates the kernel's string annotations
# with only the names its body uses in scope, so a shape or dtype named only in an annotation
# (e.g. the input dtype) raised NameError on the GPU. Eager annotations avoid that.

import functools

import tilelang
import tilelang.language as T
import torch

_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _norm_program(hidden: int, dtype: str, out_dtype: str, eps: float, threads: int):
    rows = T.dynamic("rows")

    @T.prim_func
    def rms_norm_rows(
        x: T.Tensor((rows, hidden), dtype),
        w: T.Tensor((hidden,), "float32"),
        y: T.Tensor((rows, hidden), out_dtype),
    ):
        with T.Kernel(rows, threads=threads) as row:
            vals = T.alloc_fragment((1, hidden), "float32")
            squares = T.alloc_fragment((1, hidden), "float32")
            total = T.alloc_fragment((1,), "float32")
            for i, j in T.Parallel(1, hidden):
                vals[i, j] = T.cast(x[row, j], "float32")
            for i, j in T.Parallel(1, hidden):
                squares[i, j] = vals[i, j] * vals[i, j]
            T.reduce_sum(squares, total, dim=1)
            for i in T.Parallel(1):
                total[i] = T.rsqrt(total[i] / hidden + eps)
            for i, j in T.Parallel(1, hidden):
                y[row, j] = T.cast(vals[i, j] * total[i] * w[j], out_dtype)

    return rms_norm_rows


@functools.cache
def _compiled(hidden: int, dtype: str, out_dtype: str, eps: float):
    threads = 128 if hidden <= 2048 else 256
    return tilelang.compile(_norm_program(hidden, dtype, out_dtype, eps, threads), target="cuda")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """TileLang RMSNorm over the last dimension; `weight=None` is the unweighted norm.

    `x` BF16 or FP32, or FP64 holding such values (the reference model's carrier; read as FP32).
    """
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _DTYPES:
        raise ValueError(f"rms_norm: output dtype must be bfloat16 or float32, got {out_dtype}")
    if x.dtype == torch.float64:
        x = x.float()
    if x.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: x must be bfloat16, float32 or float64, got {x.dtype}")
    hidden = x.shape[-1]
    flat = x.reshape(-1, hidden).contiguous()
    w = torch.ones(hidden, device=x.device) if weight is None else weight.float().contiguous()
    out = torch.empty(flat.shape, dtype=out_dtype, device=x.device)
    if flat.shape[0]:
        _compiled(hidden, _DTYPES[x.dtype], _DTYPES[out_dtype], float(eps))(flat, w, out)
    return out.view(x.shape)
