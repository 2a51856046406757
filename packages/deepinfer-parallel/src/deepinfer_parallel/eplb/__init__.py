"""EPLB: expert-parallel load balancing (planner, runtime state, weight shuffle)."""

from .policy import EplbPlan, greedy_rebalance, peak_sum, place, rank_loads, rebalance, replicate
from .shuffle import ShuffleStats, Transfer, shuffle_layer, transfer_plan
from .state import EplbConfig, EplbState, RebalanceReport
from .stats import MoeLoadStats

__all__ = [
    "EplbConfig",
    "EplbPlan",
    "EplbState",
    "MoeLoadStats",
    "RebalanceReport",
    "ShuffleStats",
    "Transfer",
    "greedy_rebalance",
    "peak_sum",
    "place",
    "rank_loads",
    "rebalance",
    "replicate",
    "shuffle_layer",
    "transfer_plan",
]
