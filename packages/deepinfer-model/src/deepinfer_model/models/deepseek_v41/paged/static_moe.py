"""The graph-safe MoE (`experts_forward_static`) and why a model's MoE blocks cannot take it."""

from __future__ import annotations

import torch

from ....layers.experts import ExpertWeights, experts_forward_static
from ....layers.router import route_topk, router_logits
from ..model import DeepseekV41ForCausalLM


def static_moe(model: DeepseekV41ForCausalLM, top_k: int | None = None):
    """`model.local_moe` (`blocks.moe_ffn`) with the graph-safe expert path `experts_forward_static`:
    the same router (FP32 logits, score top-k), routing weight before `w2`, same roundings. `top_k`:
    the backbone's `num_experts_per_tok` by default (the draft blocks pass their own); the returned
    function takes (layer or draft block index, its weights, input rows)."""
    cfg = model.config
    top_k = cfg.num_experts_per_tok if top_k is None else top_k

    def moe(layer: int, blk, y: torch.Tensor) -> torch.Tensor:
        w = blk.moe
        logits = router_logits(y, w.gate, model.act_dtype)
        weights, ids = route_topk(logits, w.bias, top_k, cfg.routed_scaling_factor)
        return experts_forward_static(
            y, weights, ids, w.experts, w.shared, cfg.swiglu_limit, model.act_dtype, weight_before_down=True
        )

    return moe


def _moe_blocks_problem(blocks, what: str) -> str | None:
    """Why the graph-safe expert path (`static_moe`) cannot run these blocks' MoE (None: it can);
    `what` names a block in the message ("layer", "draft block")."""
    for i, blk in enumerate(blocks):
        if blk.moe.tid2eid is not None:
            return f"{what} {i}: hash-routed MoE has no graph-safe path"
        if not isinstance(blk.moe.experts, ExpertWeights):
            return f"{what} {i}: {type(blk.moe.experts).__name__} experts have no graph-safe path"
    return None
