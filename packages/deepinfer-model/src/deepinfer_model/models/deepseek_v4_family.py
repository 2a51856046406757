"""The public DeepSeek-V4's step contract (`family.ModelFamily`): paged pools and the eager step only (no
graph-safe step, no drafter, no YOCO split: the runtime runs it eagerly)."""

from __future__ import annotations

import torch

from ..family import ModelFamily, register_family
from ..numerics import pinned
from .deepseek_v4_paged import v4_cache_specs, v4_paged_forward

_forward = pinned(v4_paged_forward)  # the numerics settings read once per step


class DeepseekV4Family(ModelFamily):
    model_type = "deepseek_v4"

    def cache_specs(self, model, block_size: int) -> list:
        return v4_cache_specs(model.config, block_size)

    def forward(self, model, meta, cache, extras=None) -> torch.Tensor:
        if extras is not None:
            raise ValueError("the public DeepSeek-V4 has no per-step extras")
        return _forward(model, meta, cache)

    def moe_blocks(self, model, part: str = "backbone") -> list:
        if part != "backbone":
            raise ValueError(f"the public DeepSeek-V4 has no {part} MoE")
        return model.layers


FAMILY = register_family(DeepseekV4Family())
