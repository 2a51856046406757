"""EPLB on an expert-parallel V4.1 model: counts from dispatch, rebalance + in-place weight shuffle."""

from __future__ import annotations

from deepinfer_parallel import EplbConfig, EplbState

from ..models.deepseek_v41.model import DeepseekV41ForCausalLM
from .ep_moe import ExpertParallelMoE


def make_eplb(model: DeepseekV41ForCausalLM, config: EplbConfig) -> EplbState:
    """An `EplbState` over the model's backbone experts; the engine calls `step()` after each forward."""
    moe = model.moe_fn
    if not isinstance(moe, ExpertParallelMoE):
        raise ValueError("make_eplb needs an expert-parallel model (load_v41_ep)")
    eplb = EplbState(moe.layout, config, moe.expert_tensors(model.weights.layers), group=moe.group)
    moe.attach_eplb(eplb)
    return eplb
