"""EPLB on an expert-parallel model: counts from dispatch, rebalance + in-place weight shuffle."""

from __future__ import annotations

from deepinfer_parallel import EplbConfig, EplbState

from .ep_moe import ExpertParallelMoE


def make_eplb(model, config: EplbConfig) -> EplbState:
    """An `EplbState` over the backbone experts of an expert-parallel V4.1 or V4 model; the engine calls
    `step()` once per forward on every EP rank."""
    moe = model.moe_fn
    if not isinstance(moe, ExpertParallelMoE):
        raise ValueError(
            "make_eplb needs an expert-parallel model (load_v41_ep, or moe_fn = ExpertParallelMoE)"
        )
    blocks = model.weights.layers if hasattr(model, "weights") else model.layers
    eplb = EplbState(moe.layout, config, moe.expert_tensors(blocks), group=moe.group)
    moe.attach_eplb(eplb)
    return eplb
