"""The graph-safe decode / verification step and why a model cannot run it."""

from __future__ import annotations

import torch

from .... import batch_invariant
from ....runtime.pools import TOKEN_IDS, PagedKVCache
from ....runtime.static_metadata import StaticDecodeMetadata
from ..model import DeepseekV41ForCausalLM
from .forward import v41_paged_forward
from .static_moe import _moe_blocks_problem, static_moe


def static_decode_problem(model) -> str | None:
    """Why `v41_static_decode_forward` cannot run this model (None: it can)."""
    if not isinstance(model, DeepseekV41ForCausalLM):
        return f"graph-safe decode is implemented for DeepSeek-V4.1 only, not {type(model).__name__}"
    if model.moe_fn != model.local_moe:
        return "graph-safe decode needs the in-process MoE (expert parallel MoE is not graph-safe here)"
    return _moe_blocks_problem(model.weights.layers, "layer")


def static_batch_invariant_problem(model: DeepseekV41ForCausalLM, drafter: bool = False) -> str | None:
    """Why the graph-safe step (`drafter`: the graph-safe draft) cannot run this model in batch-invariant
    mode on the CPU (None: it can): its expert path reproduces the eager step's grouped exact-product
    GEMMs, which need FP32-valued expert weights held in FP64 (`batch_invariant.stacked_parts`)."""
    from ....layers.experts import _bi_grouped

    blocks, what = (
        (model.weights.drafter.blocks, "draft block") if drafter else (model.weights.layers, "layer")
    )
    for i, blk in enumerate(blocks):
        ex = blk.moe.experts
        if _bi_grouped((ex.w1, ex.w3), (ex.w2,)) is None:
            return f"{what} {i}: batch-invariant experts without grouped FP64 operands (not graph-safe)"
    return None


@torch.no_grad()
def v41_static_decode_forward(
    model: DeepseekV41ForCausalLM, meta: StaticDecodeMetadata, cache: PagedKVCache
) -> torch.Tensor:
    """The graph-safe decode / verification step: FP32 logits [N, vocab], one row per query token, with
    no host sync and every shape fixed by N, the block-table width and the model (CUDA-graph
    capturable). Equal to `v41_paged_forward` of the same step on every real row; placeholder rows
    (`StaticDecodeMetadata`) write only the dummy block. Sparse attention gathers only the top-k
    selected compressed entries and the window; index sources restricted to candidate blocks score only
    those blocks; the other index sources score every entry up to the block-table width, which is the
    step's context tier (`cuda_graphs.build_context_tiers`: at most twice the longest context above the
    smallest tier), not max_context."""
    meta.reset()
    if TOKEN_IDS in cache.pools:
        cache.write(TOKEN_IDS, meta.write_slots, meta.input_ids)
    with batch_invariant.sync_free():  # (batch-invariant mode's CPU paths: no value-dependent branch)
        return v41_paged_forward(model, meta, cache, moe_fn=static_moe(model))
