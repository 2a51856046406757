"""deepinfer-parallel: process groups, balanced CP, MoE EP dispatch / combine and EPLB."""

from . import cp, ep, eplb, groups
from .cp import MirrorSplit, all_gather_restore, mirror_split, mirror_split_plan, restore_order, reverse_index
from .ep import dispatch_combine
from .ep_deepep import DeepEPDispatcher, deep_ep_available
from .eplb import EplbConfig, EplbPlan, EplbState, MoeLoadStats, rebalance
from .groups import (
    ParallelSizes,
    ParallelState,
    destroy_parallel,
    get_parallel_state,
    group_layout,
    init_parallel,
    validate_parallel_sizes,
)
from .layout import LayerExpertLayout, RedundantExpertLayout, initial_phys_to_logical, logical_maps
from .redundant import DEFAULT_EXTRA_EXPERTS, num_redundant_experts, resolve_redundant_experts

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_EXTRA_EXPERTS",
    "DeepEPDispatcher",
    "EplbConfig",
    "EplbPlan",
    "EplbState",
    "LayerExpertLayout",
    "MirrorSplit",
    "MoeLoadStats",
    "ParallelSizes",
    "ParallelState",
    "RedundantExpertLayout",
    "all_gather_restore",
    "cp",
    "deep_ep_available",
    "destroy_parallel",
    "dispatch_combine",
    "ep",
    "eplb",
    "get_parallel_state",
    "group_layout",
    "groups",
    "init_parallel",
    "initial_phys_to_logical",
    "logical_maps",
    "mirror_split",
    "mirror_split_plan",
    "num_redundant_experts",
    "rebalance",
    "resolve_redundant_experts",
    "restore_order",
    "reverse_index",
    "validate_parallel_sizes",
]
