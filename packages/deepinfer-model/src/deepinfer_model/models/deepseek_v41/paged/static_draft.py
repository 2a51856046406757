"""The graph-safe draft (greedy, or a graph-safe row sampler) and why a model cannot run it."""

from __future__ import annotations

import torch

from .... import batch_invariant
from ....runtime.pools import PagedKVCache
from ..drafter import draft_blocks_static
from ..model import DeepseekV41ForCausalLM
from .static_moe import _moe_blocks_problem, static_moe


def static_draft_problem(model) -> str | None:
    """Why `v41_static_draft` cannot run this model (None: it can)."""
    if not isinstance(model, DeepseekV41ForCausalLM) or model.weights.drafter is None:
        return "the graph-safe draft needs a DeepSeek-V4.1 model with draft blocks"
    if getattr(model, "draft_moe_fn", None) is not None:
        return "the graph-safe draft needs the drafter's in-process MoE (expert parallel is not graph-safe)"
    return _moe_blocks_problem(model.weights.drafter.blocks, "draft block")


@torch.no_grad()
def v41_static_draft(
    model: DeepseekV41ForCausalLM,
    cache: PagedKVCache,
    next_tokens: torch.Tensor,
    last_positions: torch.Tensor,
    window_slots: torch.Tensor,
    num_draft_tokens: int,
    temperatures: torch.Tensor,
    pick=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The graph-safe draft (`drafter.draft_blocks_static`): every input a device tensor of fixed
    shape, no host sync. `next_tokens`, `last_positions` long [N]; `window_slots` long [N, W] the
    `draft_main.*` slots of each sequence's window (`draft_window_slots(..., width=W)`); `temperatures`
    [k] the confidence temperatures; `pick(logits [N, V], s)` -> [N] a graph-safe row sampler (None:
    greedy). Each row equals `v41_paged_draft` with the same sampler (greedy: `greedy`) for the same
    sequence, last position and next token. -> (tokens, logits, confidence, hidden, positions)."""
    cfg, w = model.config, model.weights
    windows = torch.stack([cache.read(f"draft_main.{b}", window_slots) for b in range(len(w.drafter.blocks))])
    with batch_invariant.sync_free():  # (batch-invariant mode's CPU paths: no value-dependent branch)
        return draft_blocks_static(
            cfg,
            w.drafter,
            w.embed,
            w.head,
            windows,
            next_tokens,
            last_positions,
            num_draft_tokens,
            temperatures,
            model.act_dtype,
            model.kvq,
            static_moe(model, cfg.dspark.num_experts_per_tok),
            pick,
        )
