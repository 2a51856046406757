"""The DeepSeek-ViT encoder on the CPU reference path: one image's patch grid in, one feature per patch out.

Pre-norm blocks (RMSNorm -> fused QKV with bias -> bidirectional attention over the whole image -> output
projection; RMSNorm -> packed bias-free SwiGLU), a final RMSNorm. The only position signal is an axial 2D
rotary embedding: in each head the first half of the channels rotates by the patch's row, the second half by
its column, interleaved pairs `(x[2i], x[2i+1])` as in the text model's RoPE, with frequencies
`theta ** (-2i / (head_dim / 2))` per half.

Math runs in `dtype` (FP32 by default; FP64 for tight checks); weights are cast to it once per call.
"""

from __future__ import annotations

import torch

from .config import VisionConfig
from .weights import VisionBlockWeights, VisionWeights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


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


def _block(x: torch.Tensor, w: VisionBlockWeights, vcfg: VisionConfig, cos, sin) -> torch.Tensor:
    N, W = x.shape
    nh, dh = vcfg.num_attention_heads, vcfg.head_dim
    dt = x.dtype
    h = _rms_norm(x, w.norm1, vcfg.rms_norm_eps)
    qkv = h @ w.qkv.to(dt).T + w.qkv_bias.to(dt)
    q, k, v = (t.reshape(N, nh, dh) for t in qkv.split(W, dim=-1))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    scores = torch.einsum("qhd,khd->hqk", q, k) * dh**-0.5
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).reshape(N, W)
    x = x + attn @ w.proj.to(dt).T
    h = _rms_norm(x, w.norm2, vcfg.rms_norm_eps)
    gate, up = (h @ w.w13.to(dt).T).chunk(2, dim=-1)
    return x + (torch.nn.functional.silu(gate) * up) @ w.w2.to(dt).T


def encode_image(
    patches: torch.Tensor,
    rows: int,
    cols: int,
    weights: VisionWeights,
    vcfg: VisionConfig,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Features [rows*cols, W] of one image given its patches [rows*cols, C*p*p] in row-major order."""
    if patches.shape != (rows * cols, vcfg.patch_dim):
        raise ValueError(
            f"patches must have shape [rows*cols, C*p*p] = [{rows * cols}, {vcfg.patch_dim}], "
            f"got {list(patches.shape)}"
        )
    dev = weights.patch_embed.device
    x = patches.to(device=dev, dtype=dtype) @ weights.patch_embed.to(dtype).T + weights.patch_bias.to(dtype)
    angles = axial_rope_angles(rows, cols, vcfg.head_dim, vcfg.rope_theta, dtype).to(dev)
    cos, sin = angles.cos(), angles.sin()
    for block in weights.blocks:
        x = _block(x, block, vcfg, cos, sin)
    return _rms_norm(x, weights.norm, vcfg.rms_norm_eps)
