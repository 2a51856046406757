"""Sparse MLA decode with attention sinks over the V4.1 FP8 cache: FlashMLA's legacy SM90 kernel.

`flash_mla_with_kvcache(..., use_legacy=True, kv_format="V41")` reads the 528-byte token layout of
`deepinfer_model.ops.kv_format` directly (no dequantised copy), gathers the `indices` of every query
and folds the per-head sink into the softmax denominator.
"""

from __future__ import annotations

import torch


def sparse_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    if q.dim() != 3 or q.shape[-1] != 512 or q.shape[1] not in (64, 128):
        raise ValueError(f"q must be [B, 64 or 128, 512] for FlashMLA's SM90 kernel, got {tuple(q.shape)}")
    meta, _ = get_mla_metadata()
    out, _lse = flash_mla_with_kvcache(
        q.unsqueeze(1),
        kv_cache,
        None,
        None,
        head_dim_v=512,
        tile_scheduler_metadata=meta,
        softmax_scale=scale,
        is_fp8_kvcache=True,
        indices=indices.to(torch.int32).unsqueeze(1),
        attn_sink=sinks.float(),
        use_legacy=True,
        kv_format="V41",
    )
    return out.squeeze(1)
