"""MoE routers: score-based top-k (`sqrtsoftplus`, bias only for selection) and hash routing.

Both return `(weights [T, k] FP32, expert_ids [T, k] long)`; the weights are the *unbiased* scores of
the chosen experts normalised to sum 1 (plus 1e-20 in the denominator) and multiplied by
`routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics import carrier, linear, logits


def router_logits(x: torch.Tensor, gate: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """FP32 router logits `x @ gate.T` [T, E] (never rounded to the act dtype).

    `x` in the carrier: an FP32-output `linear` (FP64 products in exact mode, FP32 in native mode). `x`
    held in its 16-bit act dtype (native mode's narrow sub-layer input, `deepseek_v41.blocks.ShiftedHC`):
    `numerics.logits`, act-dtype operands with an FP32 accumulator and output, so x is not widened. The
    products are the FP32 GEMM's where the gate holds act-dtype values, as V4.1's layout stores it (BF16;
    a checkpoint with an F32 gate would have it rounded, as native mode does with every other weight):
    bitwise the same logits on the CPU; a GPU may sum them in another order.
    """
    if x.dtype == act_dtype and act_dtype in (torch.bfloat16, torch.float16):
        return logits(x, gate, act_dtype)
    return linear(x, gate, torch.float32)


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    """`sqrt(softplus(x))` with softplus(x) = x above 20 (computed in FP64)."""
    return F.softplus(logits.to(carrier()), beta=1.0, threshold=20.0).sqrt()


def _normalise(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    w = scores.gather(1, ids)
    return (w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling).float()


def route_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts by `score + bias` (stable: equal values -> lower expert id)."""
    scores = sqrt_softplus(logits)
    choice = scores if bias is None else scores + bias.to(carrier())
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    return _normalise(scores, ids, scaling), ids


def route_hash(
    logits: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts fixed per token id by the table `tid2eid` [vocab, k]; weights still come from the scores."""
    ids = tid2eid[token_ids.long()].long()
    return _normalise(sqrt_softplus(logits), ids, scaling), ids
