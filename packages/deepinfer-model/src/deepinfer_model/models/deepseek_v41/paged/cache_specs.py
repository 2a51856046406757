"""The paged pools a V4.1 model needs for a block size (see the package docstring for what each holds)."""

from __future__ import annotations

import torch

from ....runtime.pools import TOKEN_IDS, PoolSpec
from ....runtime.step_view import entries_per_block
from ..model import DeepseekV41ForCausalLM


def v41_cache_specs(model: DeepseekV41ForCausalLM, block_size: int) -> list[PoolSpec]:
    cfg, topo = model.config, model.config.topology
    specs = []
    if model.engram is not None:
        specs.append(PoolSpec(TOKEN_IDS, block_size, 1, torch.int64))
    for layer, ratio in enumerate(cfg.compress_ratios[: topo.num_layers]):
        specs.append(PoolSpec(f"swa.{layer}", block_size, cfg.head_dim))
        if not ratio:
            continue
        per = entries_per_block(block_size, ratio)
        if topo.is_kv_source(layer):
            specs.append(PoolSpec(f"comp.{layer}", per, cfg.head_dim))
            if ratio > 1:
                specs.append(PoolSpec(f"hidden.{layer}", block_size, cfg.hidden_size))
        if topo.is_index_k_source(layer):
            specs.append(PoolSpec(f"index_k.{layer}", per, cfg.index_head_dim))
    if model.weights.drafter is not None:  # each draft block's main key of every processed token (§7.2)
        for i in range(len(model.weights.drafter.blocks)):
            specs.append(PoolSpec(f"draft_main.{i}", block_size, cfg.head_dim))
    return specs
