"""The DeepSeek-ViT encoder: one image's patch grid in, one feature per patch out.

Pre-norm blocks (RMSNorm -> fused QKV with bias -> bidirectional attention over the whole image -> output
projection; RMSNorm -> packed bias-free SwiGLU), a final RMSNorm. The only position signal is an axial 2D
rotary embedding: in each head the first half of the channels rotates by the patch's row, the second half by
its column, interleaved pairs `(x[2i], x[2i+1])` as in the text model's RoPE, with frequencies
`theta ** (-2i / (head_dim / 2))` per half.

Numerics. `dtype` is the dtype of the weights, of every matrix product and of the attention's inputs: FP32 on
the CPU (the reference), BF16 on CUDA (`default_dtype`), FP64 for tight checks. The residual stream, the RMSNorm
statistics and the rotary rotation run in `residual_dtype(dtype)`, FP32 under 16-bit math: a BF16 residual
would round every layer's sum, and a BF16 angle (a row index times a frequency, up to ~100 rad) keeps about two
significant digits; both cost little beside the GEMMs. For FP32 and FP64 math the two dtypes are the same.

Attention (`attention=`): "reference" materialises every head's [N, N] scores with einsums (the definition;
the CPU default); "fused" calls `torch.nn.functional.scaled_dot_product_attention` with scale
`head_dim ** -0.5` and no mask, which on CUDA runs a FlashAttention-class kernel that never holds the N x N
scores (at 1,024 merged cells per image, N = 9,216 patches: 5.4 GB of FP32 scores per layer otherwise);
"auto" picks fused on CUDA and reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import VisionConfig
from .weights import VisionBlockWeights, VisionWeights

ATTENTION_MODES = ("auto", "fused", "reference")
MATH_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The encoder's math dtype on `device` when the caller names none: BF16 on CUDA, FP32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the residual stream, the RMSNorm statistics and the rotation for math in `dtype`."""
    return torch.promote_types(dtype, torch.float32)


def resolve_attention(attention: str, device: torch.device | str) -> str:
    """The attention that runs for an `attention` setting on `device`: "fused" or "reference" ("auto": fused
    on CUDA only)."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
    if attention == "auto":
        return "fused" if torch.device(device).type == "cuda" else "reference"
    return attention


def check_math_dtype(dtype: torch.dtype) -> None:
    if dtype not in MATH_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in MATH_DTYPES)
        raise ValueError(f"dtype must be one of {names}, got {dtype}")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def axial_rope_angles(
    rows: int, cols: int, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rotation angles [rows*cols, head_dim/2] of every patch (row-major grid), one per channel pair."""
    quarter = head_dim // 4
    inv = 1.0 / (theta ** (torch.arange(quarter, dtype=torch.float64) * 2 / (head_dim // 2)))
    r = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)
    c = torch.arange(cols, dtype=torch.float64).repeat(rows)
    return torch.cat([r[:, None] * inv, c[:, None] * inv], dim=1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of `x` [N, heads, head_dim] by per-patch angles ([N, head_dim/2])."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of every patch over every patch, per head ([N, heads, head_dim] in and out), through
    the explicit [heads, N, N] scores."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`reference_attention` through `scaled_dot_product_attention`. The inputs go in as [1, heads, N,
    head_dim]: the fused CUDA kernels take 4-D inputs only (3-D ones fall back to the N x N math path)."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=scale)
    return out.squeeze(0).transpose(0, 1)


_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "fused": fused_attention,
    "reference": reference_attention,
}


def _block(x: torch.Tensor, w: VisionBlockWeights, vcfg: VisionConfig, cos, sin, attend) -> torch.Tensor:
    """One pre-norm block; `x` [N, W] is the residual stream (in `residual_dtype`), `w` is cast for the math."""
    N, W = x.shape
    nh, dh = vcfg.num_attention_heads, vcfg.head_dim
    dt = w.qkv.dtype
    h = _rms_norm(x, w.norm1, vcfg.rms_norm_eps).to(dt)
    qkv = h @ w.qkv.T + w.qkv_bias
    q, k, v = (t.reshape(N, nh, dh) for t in qkv.split(W, dim=-1))
    q, k = (_rotate(t.to(cos.dtype), cos, sin).to(dt) for t in (q, k))
    attn = attend(q, k, v, dh**-0.5).reshape(N, W)
    x = x + (attn @ w.proj.T).to(x.dtype)
    h = _rms_norm(x, w.norm2, vcfg.rms_norm_eps).to(dt)
    gate, up = (h @ w.w13.T).chunk(2, dim=-1)
    return x + ((torch.nn.functional.silu(gate) * up) @ w.w2.T).to(x.dtype)


def encode_image(
    patches: torch.Tensor,
    rows: int,
    cols: int,
    weights: VisionWeights,
    vcfg: VisionConfig,
    dtype: torch.dtype | None = None,
    attention: str = "auto",
) -> torch.Tensor:
    """Features [rows*cols, W] in `residual_dtype(dtype)` of one image given its patches [rows*cols, C*p*p]
    in row-major order, on the weights' device. `dtype` None: `default_dtype` of that device. Weights not yet
    in `dtype` are cast on every call: `VisionTower` keeps them cast."""
    if patches.shape != (rows * cols, vcfg.patch_dim):
        raise ValueError(
            f"patches must have shape [rows*cols, C*p*p] = [{rows * cols}, {vcfg.patch_dim}], "
            f"got {list(patches.shape)}"
        )
    dev = weights.patch_embed.device
    dtype = default_dtype(dev) if dtype is None else dtype
    check_math_dtype(dtype)
    attend = _ATTENTION[resolve_attention(attention, dev)]
    wide = residual_dtype(dtype)
    w = weights.cast(dtype, wide)
    x = (patches.to(device=dev, dtype=dtype) @ w.patch_embed.T + w.patch_bias).to(wide)
    angles = axial_rope_angles(rows, cols, vcfg.head_dim, vcfg.rope_theta, wide).to(dev)
    cos, sin = angles.cos(), angles.sin()
    for block in w.blocks:
        x = _block(x, block, vcfg, cos, sin, attend)
    return _rms_norm(x, w.norm, vcfg.rms_norm_eps)
