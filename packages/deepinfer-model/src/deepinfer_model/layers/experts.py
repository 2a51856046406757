"""Routed experts and the shared expert: clamped SwiGLU MLPs, and the MoE combine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import batch_invariant
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
    if batch_invariant.enabled() and x.device.type == "cpu":
        bi = _bi_grouped((w.w1, w.w3), (w.w2,))
        if bi is not None:  # (the 2-D x of every caller; one group)
            flat = x.reshape(-1, x.shape[-1])
            out = _bi_swiglu(flat, [flat.shape[0]], None, *bi, limit, act_dtype, False)
            return out.reshape(*x.shape[:-1], out.shape[-1])
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
    bi = None
    if batch_invariant.enabled() and x.device.type == "cpu":
        bi = _bi_grouped((experts.w1, experts.w3), (experts.w2,))
    if bi is not None:  # batch-invariant mode: every expert in one GEMM call per projection
        ys.index_copy_(0, order, _bi_swiglu(xs, counts, ws, *bi, limit, act_dtype, weight_before_down))
    lo = 0
    for e, count in enumerate(counts if bi is None else []):  # (nothing left to do after the grouped path)
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


def _bi_grouped(up: tuple, down: tuple) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """Batch-invariant mode on the CPU: the cached grouped operands of `batch_invariant.grouped_gemm`
    (gate | up side by side, down) with the intermediate and hidden sizes, or None where it does not
    apply (weights not FP32-valued or too large to hold in FP64): the callers then take `linear`
    (`row_gemm`) per expert."""
    p13 = batch_invariant.stacked_parts(*up)
    p2 = batch_invariant.stacked_parts(*down) if p13 is not None else None
    return None if p2 is None else (p13, p2, up[0].shape[-2], down[0].shape[-2])


def _bi_swiglu(
    xs: torch.Tensor,
    counts: list[int],
    ws: torch.Tensor | None,
    p13: torch.Tensor,
    p2: torch.Tensor,
    inter: int,
    hidden: int,
    limit: float,
    act_dtype: torch.dtype,
    weight_before_down: bool,
) -> torch.Tensor:
    """Clamped SwiGLU MLPs of rows `xs` grouped by expert (`counts`), each row weighted by `ws` (None: 1),
    with the roundings of the `linear` calls of the loop (gate, up and down each rounded to act_dtype),
    in two `grouped_gemm` calls (gate and up of every expert in one, the down projections in the
    other) instead of three calls per expert. A row's result depends on that row only."""
    gu = batch_invariant.grouped_gemm(xs.double(), counts, p13)
    h = clamped_swiglu(
        round_to(gu[:, :inter], act_dtype), round_to(gu[:, inter : 2 * inter], act_dtype), limit
    )
    if ws is not None and weight_before_down:
        h = h * ws
    y = round_to(batch_invariant.grouped_gemm(h, counts, p2)[:, :hidden], act_dtype)
    return y * ws if ws is not None and not weight_before_down else y
