"""FlashMLA's legacy SM90 kernels: sparse MLA prefill over BF16 keys, and sparse MLA decode over the V4.1
FP8 cache, both with attention sinks.

`flash_mla_sparse_fwd(..., use_legacy=True)` (prefill) takes d_qk = 512 with 64 or 128 heads and a top-k
that is a multiple of 128 (measured on an H200: d_qk 512 / 576, h 64 / 128, top-k 640 and 2048
run, 600 fails the kernel's `topk % (2 * B_TOPK)` assertion; 2.1e-3 relative error against an FP32
reference, 500-650 TFLOP/s).

`flash_mla_with_kvcache(..., use_legacy=True, kv_format="V41")` reads the 528-byte token layout of
`deepinfer_model.ops.kv_format` directly (no dequantised copy), gathers the `indices` of every query
and folds the per-head sink into the softmax denominator.
"""

from __future__ import annotations

import torch

SPARSE_PREFILL_HEADS = (64, 128)
SPARSE_PREFILL_TOPK_MULTIPLE = 128


def sparse_prefill_supports(heads: int, dim: int) -> bool:
    """Whether the kernel takes queries of `heads` heads of width `dim` (else the reference serves them)."""
    return heads in SPARSE_PREFILL_HEADS and dim == 512


def sparse_prefill_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    from flash_mla import flash_mla_sparse_fwd

    t, h, d = q.shape
    if not sparse_prefill_supports(h, d) or q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise ValueError(
            f"FlashMLA's SM90 sparse prefill takes bf16 q [T, 64 or 128, 512] and kv [S, 512], got q "
            f"{tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)} {kv.dtype}"
        )
    if t == 0:
        return q.new_empty(q.shape)
    pad = -indices.shape[1] % SPARSE_PREFILL_TOPK_MULTIPLE  # unlisted columns: -1
    idx = torch.nn.functional.pad(indices.to(torch.int32), (0, pad), value=-1)
    out, _max_logits, _lse = flash_mla_sparse_fwd(
        q.contiguous(),
        kv.reshape(-1, 1, d).contiguous(),
        idx.unsqueeze(1).contiguous(),
        float(scale),
        d_v=d,
        attn_sink=sinks.float().contiguous(),
        use_legacy=True,
    )
    return out


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
