"""Interleaved RoPE as a TileLang kernel (SM90): one CTA per (token, head) row, FP32 math, one rounding.

Rows are the flattened `[T, heads]` leading dims of `x` [T, ..., C]; row `r` uses the angles of token
`r // heads`. The leading `C - 2*half` channels are copied (converted to the output dtype), the last
`2*half` rotated pairwise: `(e, o) -> (e*cos - o*sin, e*sin + o*cos)` (`sin` negated for `inverse`).
A kernel is compiled per (C, half, heads, dtypes); the row and token counts are dynamic.

`apply_rope_` rotates the last `2*half` channels of a contiguous `x` in place (`rope_tail`): it reads and
writes only them (a 512-channel BF16 query row with a 64-channel rope tail: 128 of its 1024 bytes, where
`rope_rows` reads and writes all of them), `ROPE_TAIL_PAIRS` pairs of a block of rows per CTA. Its rotation
is written exactly as `rope_rows`'s (same casts, products and operand order), so nvcc forms the same
instructions from it and the two give the same bits: checked on the PTX NVRTC makes of both lowered kernels
(sm_90a, CUDA 13.2: per pair `e*cos - o*sin` as mul, mul, sub and `e*sin + o*cos` as mul, fma).
TileLang reads the kernel function's source, so this must stay a plain `.py` module.
"""

# No `from __future__ import annotations` here: TileLang evaluates the kernel's string annotations
# with only the names its body uses in scope, so a shape or dtype named only in an annotation
# (e.g. the input dtype) raised NameError on the GPU. Eager annotations avoid that.

import functools

import tilelang
import tilelang.language as T
import torch

from ...layers.rope import check_in_place

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


# pairs one CTA (128 threads) rotates: several rows of the tail, so a CTA moves a useful amount of data
ROPE_TAIL_PAIRS = 1024


def _rows_per_cta(half: int) -> int:
    """The power of two of rows nearest below ROPE_TAIL_PAIRS / half (at least 1)."""
    return 1 << (max(1, ROPE_TAIL_PAIRS // half).bit_length() - 1)


def _rope_tail_program(channels: int, half: int, heads: int, dtype: str):
    rows, tokens = T.dynamic("rows"), T.dynamic("tokens")
    lead = channels - 2 * half
    block = _rows_per_cta(half)

    @T.prim_func
    def rope_tail(
        x: T.Tensor((rows, channels), dtype),
        cos: T.Tensor((tokens, half), "float32"),
        sin: T.Tensor((tokens, half), "float32"),
    ):
        with T.Kernel(T.ceildiv(rows, block), threads=128) as bx:
            for r, i in T.Parallel(block, half):
                row = bx * block + r
                if row < rows:
                    # both values held before either is written (the rotation reads the pair it replaces)
                    even = T.cast(x[row, lead + 2 * i], "float32")
                    odd = T.cast(x[row, lead + 2 * i + 1], "float32")
                    x[row, lead + 2 * i] = T.cast(
                        even * cos[row // heads, i] - odd * sin[row // heads, i], dtype
                    )
                    x[row, lead + 2 * i + 1] = T.cast(
                        even * sin[row // heads, i] + odd * cos[row // heads, i], dtype
                    )

    return rope_tail


@functools.cache
def _compiled_tail(channels: int, half: int, heads: int, dtype: str):
    return tilelang.compile(_rope_tail_program(channels, half, heads, dtype), target="cuda")


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


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> None:
    """TileLang RoPE of `x`'s last `2*half` channels in place (`x` contiguous BF16 or FP32): the values
    `apply_rope(x, cos, sin, inverse)` gives there, the leading channels neither read nor written."""
    check_in_place(x, cos, sin)
    half, channels = cos.shape[-1], x.shape[-1]
    if x.numel() and 2 * half == channels:
        # every channel rotated: nothing to spare, and `apply_rope`'s whole-row kernel (`rope_rows_full`) is
        # contracted differently by nvcc, so the tail kernel's FP32 results differed from it in the last bit
        # (seen on an H100): its output, copied back, keeps the in-place op bit for bit the out-of-place one
        x.copy_(apply_rope(x, cos, sin, inverse))
    elif x.numel() and half:
        heads = x[0].numel() // channels
        kernel = _compiled_tail(channels, half, heads, _DTYPES[x.dtype])
        sin = -sin if inverse else sin
        kernel(x.view(-1, channels), cos.float().contiguous(), sin.float().contiguous())
