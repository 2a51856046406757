"""NVIDIA ops written in torch (FP32 on the GPU), for ops that have no library or TileLang kernel yet.

Each is the reference math in FP32 with the reference's single rounding at the end, so it matches the
FP64 CPU reference to FP32 rounding. They are correct baselines to replace with fused kernels
(the mHC ones by DeepGEMM's `tf32_hc_prenorm_gemm` / TileKernels' `mhc.*`).
"""

from __future__ import annotations

import torch

from ...layers.rope import check_in_place


def _out(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """Output dtype: `out_dtype`, else `x`'s; FP64 inputs (the model's carrier) are read as FP32."""
    out = out_dtype or x.dtype
    if out not in (torch.float32, torch.bfloat16):
        raise ValueError(f"activation (output) dtype must be float32 or bfloat16, got {out}")
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    out = _out(x, out_dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(out)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = x.to(_out(x, out_dtype), copy=True)
    out[..., -2 * cos.shape[-1] :] = _rotated_tail(x, cos, sin, inverse, out.dtype)
    return out


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> None:
    """`apply_rope(x, ...)`'s last r channels written into `x` by the same torch ops (its values bit for bit):
    what a compiled region traces for the op where it traces `apply_rope`."""
    check_in_place(x, cos, sin)
    if cos.shape[-1]:
        x[..., x.shape[-1] - 2 * cos.shape[-1] :] = _rotated_tail(x, cos, sin, inverse, x.dtype)


def _rotated_tail(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The last r channels of `x` rotated in FP32, rounded once to `dtype` (a new tensor)."""
    half = cos.shape[-1]
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.float().reshape(view), sin.float().reshape(view)
    if inverse:
        s = -s
    tail = x[..., -2 * half :].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).to(dtype)


def hc_mixes(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    rms_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = trunk.shape[1]
    flat = trunk.float().flatten(1)
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    z = (flat @ fn.float().t()) * rstd  # FP32 GEMM (TF32 off by default in torch)
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(z[:, :m] * scale[0] + base[:m]) + hc_eps
    post = 2.0 * torch.sigmoid(z[:, m : 2 * m] * scale[1] + base[m : 2 * m])
    comb = torch.softmax((z[:, 2 * m :] * scale[2] + base[2 * m :]).view(-1, m, m), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_read(trunk: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.einsum("tm,tmh->th", weights.float(), trunk.float()).to(_out(trunk, out_dtype))


def hc_write(
    y: torch.Tensor,
    trunk: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    mixed = torch.einsum("tij,tih->tjh", comb.float(), trunk.float())
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(_out(trunk, out_dtype))


def sparse_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Gather the selected tokens of the V41 FP8 cache, dequantise, FP32 softmax with the sink logit.

    Stands in on SM90 because FlashMLA's legacy sparse decode does not take the V41 format there.
    """
    from ...ops.kv_format import unpack_fp8_tokens

    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keys = unpack_fp8_tokens(flat[indices.long().clamp(min=0)])  # [B, k, 512] FP32
    return sink_decode_from_keys(q, keys, indices, sinks, scale)


def sink_decode_from_keys(
    q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query row per sequence over its gathered keys [B, k, D] (K = V); `indices < 0` are masked."""
    scores = torch.einsum("bhd,bkd->bhk", q.float(), keys.float()) * scale
    scores = scores.masked_fill((indices < 0)[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None]
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)
    p = torch.exp(scores - top)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink - top)
    return (torch.einsum("bhk,bkd->bhd", p, keys.float()) / denom).to(torch.bfloat16)
