"""Load a V4.1 checkpoint on one EP rank: only the routed experts of its slots (spec v41-model §9.4 rule 3).

The whole checkpoint is still validated (every expert must be present with the right shape); only
the expert tensors this rank's slots need are read and dequantised.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from deepinfer_parallel import RedundantExpertLayout

from ..loader import CheckpointError, CheckpointFiles, check_checkpoint, load_tensors
from ..models.deepseek_v41.config import DeepseekV41Config
from ..models.deepseek_v41.engram_vocab import CompressedVocabulary
from ..models.deepseek_v41.layout import checkpoint_layout
from ..models.deepseek_v41.loader import ignored_prefixes
from ..models.deepseek_v41.model import DeepseekV41ForCausalLM
from ..models.deepseek_v41.weights import V41Weights
from .ep_moe import ExpertParallelMoE


def remote_expert_prefixes(layout: RedundantExpertLayout, ep_rank: int) -> tuple[str, ...]:
    """HF name prefixes of the backbone experts that no local slot of `ep_rank` holds."""
    out = []
    for layer in range(layout.num_layers):
        local = set(layout.local_logical(layer, ep_rank))
        out += [f"layers.{layer}.ffn.experts.{e}." for e in range(layout.num_logical) if e not in local]
    return tuple(out)


def load_v41_ep(
    path: str | Path,
    layout: RedundantExpertLayout,
    group: dist.ProcessGroup | None = None,
    act_dtype: torch.dtype = torch.float32,
) -> DeepseekV41ForCausalLM:
    """The V4.1 model of this EP rank: dense parts and the drafter whole, backbone experts by slot.

    Returns a model whose `moe_fn` is an `ExpertParallelMoE` over `group` (collective per MoE layer).
    """
    cfg = DeepseekV41Config.from_file(path)
    ep_rank = dist.get_rank(group)
    full = checkpoint_layout(cfg)
    files = CheckpointFiles(path)
    try:
        problems = check_checkpoint(files, full, cfg, ignored_prefixes(cfg))
    finally:
        files.close()
    if problems:
        raise CheckpointError(path, problems)
    skip = remote_expert_prefixes(layout, ep_rank)
    wanted = {name: spec for name, spec in full.items() if not name.startswith(skip)}
    tensors = load_tensors(path, cfg, wanted, torch.float32, ignored_prefixes=ignored_prefixes(cfg) + skip)
    weights = V41Weights.from_tensors(
        cfg, tensors.__getitem__, local_experts=lambda layer: layout.local_logical(layer, ep_rank)
    )
    vocab = CompressedVocabulary.from_file(path) if cfg.engram else None
    moe = ExpertParallelMoE(cfg, layout, group, act_dtype)
    return DeepseekV41ForCausalLM(cfg, weights, vocab, act_dtype, moe_fn=moe)
