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


def remote_expert_prefixes(
    layout: RedundantExpertLayout, ep_rank: int, prefix: str = "layers"
) -> tuple[str, ...]:
    """HF name prefixes of the experts no local slot of `ep_rank` holds (`prefix` "layers": backbone,
    "mtp": draft blocks)."""
    out = []
    for layer in range(layout.num_layers):
        local = set(layout.local_logical(layer, ep_rank))
        out += [f"{prefix}.{layer}.ffn.experts.{e}." for e in range(layout.num_logical) if e not in local]
    return tuple(out)


def load_v41_ep(
    path: str | Path,
    layout: RedundantExpertLayout,
    group: dist.ProcessGroup | None = None,
    act_dtype: torch.dtype = torch.float32,
    draft_layout: RedundantExpertLayout | None = None,
    device: torch.device | str = "cpu",
) -> DeepseekV41ForCausalLM:
    """The V4.1 model of this EP rank: dense parts whole, backbone experts by slot of `layout`, on
    `device` (this rank's GPU, e.g. `cuda:{local_rank}`, with an NCCL group).

    Returns a model whose `moe_fn` is an `ExpertParallelMoE` over `group` (collective per MoE layer).
    With `draft_layout` the draft blocks' experts are sharded the same way (`draft_moe_fn`, collective
    per draft block whenever a rank drafts); without it every rank holds all of them.
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
    if draft_layout is not None:
        if cfg.dspark is None:
            raise ValueError("draft_layout given but the checkpoint has no draft blocks")
        skip += remote_expert_prefixes(draft_layout, ep_rank, "mtp")
    wanted = {name: spec for name, spec in full.items() if not name.startswith(skip)}
    tensors = load_tensors(
        path, cfg, wanted, torch.float32, ignored_prefixes=ignored_prefixes(cfg) + skip, device=device
    )
    weights = V41Weights.from_tensors(
        cfg,
        tensors.__getitem__,
        local_experts=lambda layer: layout.local_logical(layer, ep_rank),
        local_draft_experts=draft_layout and (lambda block: draft_layout.local_logical(block, ep_rank)),
    )
    vocab = CompressedVocabulary.from_file(path) if cfg.engram else None
    moe = ExpertParallelMoE(cfg, layout, group, act_dtype)
    draft_moe = draft_layout and ExpertParallelMoE(cfg, draft_layout, group, act_dtype, part="drafter")
    return DeepseekV41ForCausalLM(cfg, weights, vocab, act_dtype, moe_fn=moe, draft_moe_fn=draft_moe)
