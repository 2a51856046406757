"""RMSNorm: FP64 statistics over the last dimension, one rounding of the output."""

from __future__ import annotations

import torch

from ..numerics import carrier, round_to


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, act_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight`; `weight=None` is the unweighted norm (public V4 per-head q norm)."""
    x = x.to(carrier())
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(carrier())
    return round_to(y, act_dtype)
