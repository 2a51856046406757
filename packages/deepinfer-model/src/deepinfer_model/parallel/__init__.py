"""Parallel execution of the V4.1 model on deepinfer-parallel: expert-parallel MoE (with redundant
experts and EPLB), per-rank loading of local experts, and context-parallel prefill.

    state = deepinfer_parallel.init_parallel(dp=2, ep=2)
    layout = RedundantExpertLayout(cfg.n_routed_experts, extra, ep_size=2, num_layers=cfg.num_hidden_layers)
    model = load_v41_ep(path, layout, state.ep.group, draft_layout=draft_layout)  # local experts only
    eplb = make_eplb(model, EplbConfig.from_env())         # optional: counts + rebalance + shuffle
    out = model.forward(token_ids)                         # collective over the EP group
    out = cp_prefill(model, token_ids, state.cp.group)     # CP prefill: same output on every CP rank
"""

from .cp_prefill import MirrorRows, cp_prefill
from .ep_moe import ExpertParallelMoE, shard_experts
from .eplb import make_eplb
from .loading import load_v41_ep, remote_expert_prefixes

__all__ = [
    "ExpertParallelMoE",
    "MirrorRows",
    "cp_prefill",
    "load_v41_ep",
    "make_eplb",
    "remote_expert_prefixes",
    "shard_experts",
]
