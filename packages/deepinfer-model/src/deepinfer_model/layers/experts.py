"""Routed experts and the shared expert: clamped SwiGLU MLPs, and the MoE combine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import carrier, linear, round_to


@dataclass
class MLPWeights:
    """One SwiGLU MLP: `w1` (gate) and `w3` (up) [I, H], `w2` (down) [H, I]; dequantised."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor


@dataclass
class ExpertWeights:
    """All routed experts stacked: `w1`, `w3` [E, I, H], `w2` [E, H, I]."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`silu(min(gate, L)) * clamp(up, -L, L)` (FP64, unrounded)."""
    g = gate.to(carrier()).clamp(max=limit)
    return g * torch.sigmoid(g) * up.to(carrier()).clamp(-limit, limit)


def mlp(x: torch.Tensor, w: MLPWeights, limit: float, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unweighted clamped SwiGLU MLP (the shared expert) -> [T, H] rounded to act_dtype."""
    h = clamped_swiglu(linear(x, w.w1, act_dtype), linear(x, w.w3, act_dtype), limit)
    return linear(h, w.w2, act_dtype)


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: ExpertWeights,
    shared: MLPWeights | None,
    limit: float,
    act_dtype: torch.dtype = torch.float32,
    weight_before_down: bool = False,
) -> torch.Tensor:
    """Sum over the k routed slots (in slot order) plus the shared expert, FP64, one rounding -> [T, H].

    `weight_before_down` scales the SwiGLU output by the routing weight before `w2` (V4.1); the public V4
    scales the expert output after `w2`. Equal in exact arithmetic.
    """
    t, k = ids.shape
    out = torch.zeros(t, x.shape[1], dtype=carrier(), device=x.device)
    for slot in range(k):
        for e in torch.unique(ids[:, slot]).tolist():
            rows = (ids[:, slot] == e).nonzero(as_tuple=True)[0]
            xr = x[rows]
            h = clamped_swiglu(
                linear(xr, experts.w1[e], act_dtype), linear(xr, experts.w3[e], act_dtype), limit
            )
            wr = weights[rows, slot].to(carrier()).unsqueeze(-1)
            if weight_before_down:
                y = linear(h * wr, experts.w2[e], act_dtype)
            else:
                y = linear(h, experts.w2[e], act_dtype) * wr
            out[rows] += y
    if shared is not None:
        out += mlp(x, shared, limit, act_dtype)
    return round_to(out, act_dtype)
