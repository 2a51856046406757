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
    """`silu(min(gate, L)) * clamp(up, -L, L)` in the carrier dtype (`numerics.carrier()`), unrounded."""
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
    experts: ExpertWeights,  # or quant_sm90.Fp8Experts
    shared: MLPWeights | None,
    limit: float,
    act_dtype: torch.dtype = torch.float32,
    weight_before_down: bool = False,
) -> torch.Tensor:
    """Sum over the k routed slots (in slot order) plus the shared expert, in the carrier dtype, one rounding -> [T, H].

    `weight_before_down` scales the SwiGLU output by the routing weight before `w2` (V4.1); the public V4
    scales the expert output after `w2`. Equal in exact arithmetic.

    `experts` may also be `quant_sm90.Fp8Experts` (loaded with `DEEPINFER_FP8_EXPERTS=1`): the routed
    sum then comes from the `grouped_expert_mlp` op (FP8 1x128 activation casts, BF16 GEMM outputs, an
    FP32 sum over slots), the shared expert is added and the result rounded once, as here.
    """
    if not isinstance(experts, ExpertWeights):
        from ..quant_sm90 import Fp8Experts

        if isinstance(experts, Fp8Experts):
            # ops -> backends -> layers: imported at call time
            from ..ops.model_calls import grouped_expert_mlp

            out = grouped_expert_mlp(x, weights, ids, experts, limit, weight_before_down)
            if shared is not None:
                out += mlp(x, shared, limit, act_dtype)
            return round_to(out, act_dtype)
    t, k = ids.shape
    n_experts = experts.w1.shape[0]
    # One host sync per call: the (token, slot) pairs are sorted by expert id (stable, so each expert's
    # rows keep token-major order) and only the per-expert counts are read back; every gather below is
    # an integer index, never a boolean mask (each `nonzero` / `unique` is a device->host sync).
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()  # the only host sync
    if len(counts) > n_experts:
        raise ValueError(f"expert ids must lie in [0, {n_experts}), got an id {len(counts) - 1}")
    xs = x[torch.div(order, k, rounding_mode="floor")]  # [T*k, H] rows grouped by expert
    ws = weights.reshape(-1)[order].to(carrier()).unsqueeze(-1)
    # y of pair p = t*k + slot lands in row p of `ys`, i.e. ys.view(T, k, H)[t, slot]
    ys = torch.empty(t * k, x.shape[1], dtype=carrier(), device=x.device)
    lo = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        hi = lo + count
        xr, wr = xs[lo:hi], ws[lo:hi]
        h = clamped_swiglu(linear(xr, experts.w1[e], act_dtype), linear(xr, experts.w3[e], act_dtype), limit)
        if weight_before_down:
            y = linear(h * wr, experts.w2[e], act_dtype)
        else:
            y = linear(h, experts.w2[e], act_dtype) * wr
        ys.index_copy_(0, order[lo:hi], y)  # indices are distinct: deterministic
        lo = hi
    ys = ys.view(t, k, x.shape[1])
    # slot order, from zeros (0 + y is y except for -0.0), exactly as the per-slot accumulation did
    out = torch.zeros(t, x.shape[1], dtype=carrier(), device=x.device)
    for slot in range(k):
        out += ys[:, slot]
    if shared is not None:
        out += mlp(x, shared, limit, act_dtype)
    return round_to(out, act_dtype)
