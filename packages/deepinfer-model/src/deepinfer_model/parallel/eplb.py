"""EPLB on an expert-parallel model: counts from dispatch, rebalance + in-place weight shuffle."""

from __future__ import annotations

from deepinfer_parallel import EplbConfig, EplbState

from ..family import family_of
from .ep_moe import ExpertParallelMoE


def make_eplb(model, config: EplbConfig, part: str = "backbone") -> EplbState:
    """An `EplbState` over the backbone (or V4.1 draft-block, `part="drafter"`) experts of an
    expert-parallel V4.1 or V4 model; the engine calls `step()` once per forward on every EP rank."""
    if part not in ("backbone", "drafter"):
        raise ValueError(f"part must be 'backbone' or 'drafter', got {part!r}")
    moe = model.moe_fn if part == "backbone" else getattr(model, "draft_moe_fn", None)
    if not isinstance(moe, ExpertParallelMoE):
        raise ValueError(f"make_eplb needs an expert-parallel {part} MoE (load_v41_ep / ExpertParallelMoE)")
    blocks = family_of(model).moe_blocks(model, part)
    eplb = EplbState(moe.layout, config, moe.expert_tensors(blocks), group=moe.group)
    moe.attach_eplb(eplb)
    return eplb
