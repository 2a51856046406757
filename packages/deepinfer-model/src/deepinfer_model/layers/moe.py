"""The MoE feed-forward block of one layer: router (score top-k or hash) + routed experts + shared expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .experts import ExpertWeights, MLPWeights, experts_forward
from .router import route_hash, route_topk, router_logits


@dataclass
class MoEWeights:
    """`gate` [E, H]; `bias` [E] (score-routed layers) or `tid2eid` [vocab, k] (hash-routed layers)."""

    gate: torch.Tensor
    experts: ExpertWeights
    shared: MLPWeights | None
    bias: torch.Tensor | None = None
    tid2eid: torch.Tensor | None = None


def moe_block(
    x: torch.Tensor,
    token_ids: torch.Tensor,
    w: MoEWeights,
    top_k: int,
    routed_scaling_factor: float,
    swiglu_limit: float,
    act_dtype: torch.dtype = torch.float32,
    weight_before_down: bool = False,
) -> torch.Tensor:
    """MoE output [T, H] (carrier dtype) for the normed layer input `x` [T, H] of tokens `token_ids` [T].

    `x` is in the carrier dtype, or (native mode, `numerics.narrow_act`) held in the 16-bit act dtype: the
    router (`router_logits`) and the experts' GEMMs take it as it is, with the same values."""
    logits = router_logits(x, w.gate, act_dtype)  # router logits stay FP32
    if w.tid2eid is not None:
        weights, ids = route_hash(logits, token_ids, w.tid2eid, routed_scaling_factor)
    else:
        weights, ids = route_topk(logits, w.bias, top_k, routed_scaling_factor)
    return experts_forward(x, weights, ids, w.experts, w.shared, swiglu_limit, act_dtype, weight_before_down)
