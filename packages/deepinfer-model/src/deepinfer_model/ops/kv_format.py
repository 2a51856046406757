"""Byte layout of the V4.1 FP8 KV cache (spec v41-model 4.9, `V41_FORMAT`): 528 bytes per token.

A token's 512 latent values are stored as FP8-E4M3 (bytes 0..511) followed by 16 UE8M0 scales
(bytes 512..527), one per 32 consecutive values. Quantisation is the Q8 rule of spec 10.3:
`scale = 2^ceil(log2(max(amax, 1e-4) / 448))`, `q = RNE_e4m3(clamp(x / scale, +-448))`.
FlashMLA's SM90 sparse decode reads exactly this layout (`kv_format="V41"`).
Plain torch, so the same code runs on any device.
"""

from __future__ import annotations

import torch

from ..quant import E4M3_MAX, pow2_ceil

LATENT_DIM = 512
GROUP = 32
BYTES_PER_TOKEN = LATENT_DIM + LATENT_DIM // GROUP  # 528


def pack_fp8_tokens(latent: torch.Tensor) -> torch.Tensor:
    """[T, 512] float -> uint8 [T, 528] in the V41 cache layout."""
    if latent.dim() != 2 or latent.shape[1] != LATENT_DIM:
        raise ValueError(f"latent must be [T, {LATENT_DIM}], got {tuple(latent.shape)}")
    g = latent.float().reshape(latent.shape[0], LATENT_DIM // GROUP, GROUP)
    scale = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=1e-4) / E4M3_MAX)
    q = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(latent.shape[0], LATENT_DIM)
    _, exp = torch.frexp(scale.squeeze(-1))  # scale = 0.5 * 2^exp exactly
    ue8m0 = (exp - 1 + 127).clamp(0, 254).to(torch.uint8)
    return torch.cat((q.view(torch.uint8), ue8m0), dim=1)


def unpack_fp8_tokens(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 528] -> FP32 [..., 512] (exact: every stored value is representable in FP32)."""
    if packed.shape[-1] != BYTES_PER_TOKEN or packed.dtype != torch.uint8:
        raise ValueError(
            f"packed must be uint8 [..., {BYTES_PER_TOKEN}], got {packed.dtype} {tuple(packed.shape)}"
        )
    data = packed[..., :LATENT_DIM].contiguous().view(torch.float8_e4m3fn).float()
    exp = packed[..., LATENT_DIM:].to(torch.int32) - 127
    scale = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
    return data * scale.repeat_interleave(GROUP, dim=-1)


def store_fp8_tokens(latent: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write `latent` [T, 512] into `kv_cache` uint8 [blocks, page, 1, 528] at flat `slots` [T]."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[2:] != (1, BYTES_PER_TOKEN):
        raise ValueError(
            f"kv_cache must be uint8 [blocks, page, 1, {BYTES_PER_TOKEN}], got {tuple(kv_cache.shape)}"
        )
    if slots.shape != (latent.shape[0],):
        raise ValueError(f"slots must be [T={latent.shape[0]}], got {tuple(slots.shape)}")
    n = kv_cache.shape[0] * kv_cache.shape[1]
    if latent.shape[0] and (int(slots.min()) < 0 or int(slots.max()) >= n):
        raise ValueError(f"slots must lie in [0, {n}), got [{int(slots.min())}, {int(slots.max())}]")
    kv_cache.view(n, BYTES_PER_TOKEN)[slots.long()] = pack_fp8_tokens(latent)
