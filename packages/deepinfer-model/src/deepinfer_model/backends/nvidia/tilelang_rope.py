"""Interleaved RoPE as a TileLang kernel (SM90): one CTA per (token, head) row, FP32 math, one rounding.

Rows are the flattened `[T, heads]` leading dims of `x` [T, ..., C]; row `r` uses the angles of token
`r // heads`. The leading `C - 2*half` channels are copied (converted to the output dtype), the last
`2*half` rotated pairwise: `(e, o) -> (e*cos - o*sin, e*sin + o*cos)` (`sin` negated for `inverse`).
A kernel is compiled per (C, half, heads, dtypes); the row and token counts are dynamic.
TileLang reads the kernel function's source, so this must stay a plain `.py` module.
"""

# No `from __future__ import annotations` here: TileLang evaluates the kernel's string annotations
# with only the names its body uses in scope, so a shape or dtype named only in an annotation
# (e.g. the input dtype) raised NameError on the H200 (2026-11-29). Eager annotations avoid that.

import functools

import tilelang
import tilelang.language as T
import torch

_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _rope_program(channels: int, half: int, heads: int, in_dtype: str, out_dtype: str):
    rows, tokens = T.dynamic("rows"), T.dynamic("tokens")
    lead = channels - 2 * half

    @T.prim_func
    def rope_rows(
        x: T.Tensor((rows, channels), in_dtype),
        cos: T.Tensor((tokens, half), "float32"),
        sin: T.Tensor((tokens, half), "float32"),
        y: T.Tensor((rows, channels), out_dtype),
    ):
        with T.Kernel(rows, threads=128) as row:
            for j in T.Parallel(lead):
                y[row, j] = T.cast(x[row, j], out_dtype)
            for i in T.Parallel(half):
                y[row, lead + 2 * i] = T.cast(
                    T.cast(x[row, lead + 2 * i], "float32") * cos[row // heads, i]
                    - T.cast(x[row, lead + 2 * i + 1], "float32") * sin[row // heads, i],
                    out_dtype,
                )
                y[row, lead + 2 * i + 1] = T.cast(
                    T.cast(x[row, lead + 2 * i], "float32") * sin[row // heads, i]
                    + T.cast(x[row, lead + 2 * i + 1], "float32") * cos[row // heads, i],
                    out_dtype,
                )

    @T.prim_func
    def rope_rows_full(  # every channel rotated (no pass-through part): T.Parallel(0) is not allowed
        x: T.Tensor((rows, channels), in_dtype),
        cos: T.Tensor((tokens, half), "float32"),
        sin: T.Tensor((tokens, half), "float32"),
        y: T.Tensor((rows, channels), out_dtype),
    ):
        with T.Kernel(rows, threads=128) as row:
            for i in T.Parallel(half):
                y[row, 2 * i] = T.cast(
                    T.cast(x[row, 2 * i], "float32") * cos[row // heads, i]
                    - T.cast(x[row, 2 * i + 1], "float32") * sin[row // heads, i],
                    out_dtype,
                )
                y[row, 2 * i + 1] = T.cast(
                    T.cast(x[row, 2 * i], "float32") * sin[row // heads, i]
                    + T.cast(x[row, 2 * i + 1], "float32") * cos[row // heads, i],
                    out_dtype,
                )

    return rope_rows if lead > 0 else rope_rows_full


@functools.cache
def _compiled(channels: int, half: int, heads: int, in_dtype: str, out_dtype: str):
    return tilelang.compile(_rope_program(channels, half, heads, in_dtype, out_dtype), target="cuda")


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """TileLang RoPE; `x` BF16, FP32 or FP64 (read as FP32: the model's FP64 carrier holds FP32 values)."""
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _DTYPES:
        raise ValueError(f"apply_rope: output dtype must be bfloat16 or float32, got {out_dtype}")
    if x.dtype == torch.float64:
        x = x.float()
    if x.dtype not in _DTYPES:
        raise ValueError(f"apply_rope: x must be bfloat16, float32 or float64, got {x.dtype}")
    half, channels = cos.shape[-1], x.shape[-1]
    if cos.shape != sin.shape or cos.shape[0] != x.shape[0] or 2 * half > channels:
        raise ValueError(
            f"apply_rope: cos/sin must be [T={x.shape[0]}, r/2] with r <= {channels}, "
            f"got {tuple(cos.shape)} / {tuple(sin.shape)}"
        )
    heads = x[0].numel() // channels if x.shape[0] else 1
    flat = x.reshape(-1, channels).contiguous()
    out = torch.empty(flat.shape, dtype=out_dtype, device=x.device)
    if flat.shape[0]:
        kernel = _compiled(channels, half, heads, _DTYPES[flat.dtype], _DTYPES[out_dtype])
        sin = -sin if inverse else sin  # the conjugate rotation: exact negation, no second kernel
        kernel(flat, cos.float().contiguous(), sin.float().contiguous(), out)
    return out.view(x.shape)
