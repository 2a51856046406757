"""Manifold-constrained hyper-connections (mHC): `m` residual streams mixed around every sub-layer.

Trunk `R` is [T, m, H]. A sub-layer's mixes come from the flattened trunk:
`pre` [T, m] (how streams are read into the sub-layer), `post` [T, m] (how its output is written back)
and `comb` [T, m, m] (doubly-stochastic stream mixing, `comb[i, j]` = stream i -> stream j).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import batch_invariant
from ..numerics import carrier, round_to, weight_carrier


@dataclass
class HCParams:
    """One sub-layer's mix parameters (FP32): `fn` [(2+m)m, mH] (trunk norm weight folded in), `base`, `scale` [3]."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


@dataclass
class HCHeadParams:
    """Final collapse of the non-shifted variant: `fn` [m, mH], `base` [m], `scale` [1]."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


def expand(x: torch.Tensor, m: int) -> torch.Tensor:
    """[T, H] -> [T, m, H], every stream a copy of `x` (the trunk entering layer 0)."""
    return x.to(carrier()).unsqueeze(1).expand(-1, m, -1).contiguous()


def _normed_projection(trunk: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    flat = trunk.to(carrier()).flatten(1)
    inv = torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    if batch_invariant.enabled():
        if trunk.dtype != flat.dtype or batch_invariant.marked_fp32_valued(trunk):
            batch_invariant.mark_fp32_valued(flat)  # known FP32-valued: no test of every value per call
        # the row scale after the product (equal in exact arithmetic): the trunk holds FP32/BF16 values,
        # so the mode multiplies them in its one exact-product GEMM per call instead of the fixed row
        # tiles that full-FP64 (scaled) rows need; a row's result still depends on that row only
        return batch_invariant.matmul(flat, weight_carrier(fn).t()) * inv
    return batch_invariant.matmul(flat * inv, weight_carrier(fn).t())


def sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """Row softmax + eps, then column / row normalisation (column first), eps in every denominator."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mixes(
    trunk: torch.Tensor, p: HCParams, hc_eps: float, rms_eps: float, sinkhorn_iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, m], post [T, m], comb [T, m, m]) of one sub-layer, all FP32."""
    m = trunk.shape[1]
    z = _normed_projection(trunk, p.fn, rms_eps)
    scale, base = p.scale.to(carrier()), p.base.to(carrier())
    pre = torch.sigmoid(z[:, :m] * scale[0] + base[:m]) + hc_eps
    post = 2.0 * torch.sigmoid(z[:, m : 2 * m] * scale[1] + base[m : 2 * m])
    comb_logits = (z[:, 2 * m :] * scale[2] + base[2 * m :]).view(-1, m, m)
    comb = sinkhorn(comb_logits, hc_eps, sinkhorn_iters)
    return round_to(pre, torch.float32), round_to(post, torch.float32), round_to(comb, torch.float32)


def read(trunk: torch.Tensor, weights: torch.Tensor, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sub-layer input `sum_i w[i] * R[i]` -> [T, H] (FP32 accumulation, one rounding)."""
    return round_to((weights.to(carrier()).unsqueeze(-1) * trunk.to(carrier())).sum(dim=1), act_dtype)


def write(
    y: torch.Tensor,
    trunk: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """New trunk `R'[j] = post[j] * y + sum_i comb[i, j] * R[i]` -> [T, m, H]."""
    mixed = torch.einsum("tij,tih->tjh", comb.to(carrier()), trunk.to(carrier()))
    return round_to(post.to(carrier()).unsqueeze(-1) * y.to(carrier()).unsqueeze(1) + mixed, act_dtype)


def head_weights(trunk: torch.Tensor, p: HCHeadParams, hc_eps: float, rms_eps: float) -> torch.Tensor:
    """Read weights [T, m] of the final HC head (non-shifted checkpoints)."""
    z = _normed_projection(trunk, p.fn, rms_eps)
    return round_to(torch.sigmoid(z * p.scale.to(carrier()) + p.base.to(carrier())) + hc_eps, torch.float32)
