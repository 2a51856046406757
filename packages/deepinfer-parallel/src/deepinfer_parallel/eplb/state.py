"""Runtime EPLB: per-step expert counts, a sliding window, periodic rebalancing (engine spec §7.5).

The model passes ``state.expert_count[layer]`` to ``dispatch_combine`` (which adds the rows each local
physical slot processed) and the engine calls ``state.step(is_prompt)`` once per forward on every EP
rank. Every ``interval`` steps (the first time after a quarter of a period) the window's counts are
summed over the EP group, planned with ``rebalance``, the weights are shuffled and the layout's maps
are updated in place.

A rebalance (and each load-statistic flush) is a collective ordinary steps do not carry: listeners
added with ``add_listener`` hear of each one as ``(kind, start, end)``, ``kind`` ``"eplb_rebalance"``
or ``"moe_lb_flush"``, the times ``time.perf_counter()`` values of this process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepinfer_cluster import envs

from ..layout import RedundantExpertLayout
from .policy import rank_loads, rebalance
from .shuffle import ShuffleStats, shuffle_layer
from .stats import MoeLoadStats

logger = logging.getLogger(__name__)


@dataclass
class EplbConfig:
    """``interval`` 0 disables rebalancing; ``window`` steps of history (``1 <= window <= interval``)."""

    interval: int = 0
    window: int = 100
    rearrange_after_prefill: bool = False
    normal_engine: bool = True  # NORMAL engines ignore prefill steps unless rearrange_after_prefill
    p2p_groups: int = 1
    # Plan on at most this many buckets of consecutive steps (0: every step, as the reference). 1 plans on
    # the window's total, which bench_eplb.py finds more robust when the hot set drifts.
    max_window_steps: int = 0

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"EPLB interval must be >= 0, got {self.interval}")
        if self.interval > 0 and not 1 <= self.window <= self.interval:
            raise ValueError(f"EPLB window must be in [1, interval={self.interval}], got {self.window}")
        if self.p2p_groups < 1:
            raise ValueError(f"p2p_groups must be >= 1, got {self.p2p_groups}")
        if self.max_window_steps < 0:
            raise ValueError(f"max_window_steps must be >= 0, got {self.max_window_steps}")

    @classmethod
    def from_env(cls, normal_engine: bool = True) -> EplbConfig:
        interval = envs.get("DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL")
        window = envs.get("DEEPINFER_EXPERT_COUNT_WINDOW_SIZE")
        if interval > 0:
            window = min(window, interval)
        return cls(
            interval=interval,
            window=window,
            rearrange_after_prefill=envs.get("DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE"),
            normal_engine=normal_engine,
            p2p_groups=envs.get("DEEPINFER_REARRANGE_P2P_GROUPS"),
            max_window_steps=envs.get("DEEPINFER_EPLB_MAX_WINDOW_STEPS"),
        )


@dataclass
class RebalanceReport:
    step: int
    imbalance_before: float  # sum_t max_r load / sum_t mean_r load over the window (1.0 = perfect)
    imbalance_after: float
    layers_changed: int
    shuffle: ShuffleStats
    bytes_moved_total: int  # over the whole EP group
    seconds: float
    per_layer: list = field(default_factory=list)


class EplbState:
    """EPLB bookkeeping of one group of MoE layers sharing a layout (e.g. the backbone's)."""

    def __init__(
        self,
        layout: RedundantExpertLayout,
        config: EplbConfig,
        expert_weights: list[list[torch.Tensor]] | None = None,
        group: dist.ProcessGroup | None = None,
        lb_stat_interval: int | None = None,
    ):
        self.layout, self.config, self.group = layout, config, group
        self.expert_weights = expert_weights  # per layer: tensors [slots_per_rank, ...]
        self.ep_rank = dist.get_rank(group) if dist.is_initialized() else 0
        if dist.is_initialized() and dist.get_world_size(group) != layout.ep_size:
            raise ValueError(f"layout ep_size={layout.ep_size} != EP group size {dist.get_world_size(group)}")
        if expert_weights is not None and len(expert_weights) != layout.num_layers:
            raise ValueError(
                f"expert_weights has {len(expert_weights)} layers, the layout {layout.num_layers}"
            )
        device = layout.phys_to_logical.device
        self.expert_count = torch.zeros(
            layout.num_layers, layout.slots_per_rank, dtype=torch.int64, device=device
        )
        # Window entries are *logical* counts, so they stay meaningful after a re-placement.
        self.window = torch.zeros(
            max(config.window, 1), layout.num_layers, layout.num_logical, dtype=torch.int64
        )
        self.filled = 0
        self.head = 0
        interval = config.interval
        self.counter = interval - max(1, interval // 4) if interval else 0  # first rebalance after 1/4 period
        self.pending_after_prefill = False
        self.steps = 0
        self.reports: list[RebalanceReport] = []
        # moe_lb: sum of per-(step, layer) peak over mean rank load, all-gathered every N steps.
        self.load_stats = MoeLoadStats(layout.num_layers, lb_stat_interval, group, device)
        self.listeners: list[Callable[[str, float, float], None]] = []

    def add_listener(self, fn: Callable[[str, float, float], None]) -> None:
        """Call ``fn(kind, start, end)`` after every rebalance and every load-statistic flush."""
        if fn not in self.listeners:
            self.listeners.append(fn)
        self.load_stats.add_listener(fn)

    def _push(self) -> None:
        slots = self.layout.local_slots(self.ep_rank)
        local_map = self.layout.phys_to_logical[:, slots.start : slots.stop].cpu()
        logical = torch.zeros(self.layout.num_layers, self.layout.num_logical, dtype=torch.int64)
        logical.scatter_add_(1, local_map, self.expert_count.cpu())
        self.window[self.head] = logical
        self.head = (self.head + 1) % self.window.shape[0]
        self.filled = min(self.filled + 1, self.window.shape[0])

    def step(self, is_prompt: bool = False) -> RebalanceReport | None:
        """Per-forward bookkeeping on every EP rank; returns a report when it rebalanced."""
        self.steps += 1
        cfg = self.config
        report = None
        self.load_stats.record(self.expert_count.sum(dim=1))
        try:
            if cfg.interval == 0:
                return None
            if self.pending_after_prefill and not is_prompt:
                self.pending_after_prefill = False
                self.counter = 0
                report = self.rearrange()
            if is_prompt and cfg.normal_engine and not cfg.rearrange_after_prefill:
                return report
            self._push()
            if is_prompt and cfg.rearrange_after_prefill:
                self.pending_after_prefill = True
            self.counter += 1
            if self.counter >= cfg.interval:
                self.counter = 0
                report = self.rearrange()
            return report
        finally:
            self.expert_count.zero_()

    def window_tokens(self) -> torch.Tensor:
        """The window's logical counts summed over the EP group, oldest step first: ``[W, L, E]``."""
        n = self.filled
        idx = [(self.head - n + i) % self.window.shape[0] for i in range(n)]
        tokens = self.window[idx].clone()
        if dist.is_initialized() and self.layout.ep_size > 1:
            # On the counts' device: NCCL groups reduce CUDA tensors only.
            on_device = tokens.to(self.expert_count.device)
            dist.all_reduce(on_device, group=self.group)
            tokens = on_device.cpu()
        return tokens

    def rearrange(self) -> RebalanceReport | None:
        """Plan from the window, shuffle the weights, update the maps in place (collective over EP)."""
        if self.filled == 0:
            return None
        start = time.perf_counter()
        tokens = self.window_tokens().double()
        layout = self.layout
        old = layout.phys_to_logical.cpu().numpy().copy()
        plan = rebalance(
            tokens, layout.num_physical, layout.ep_size, current=old,
            max_window_steps=self.config.max_window_steps or None,
        )  # fmt: skip
        stats = ShuffleStats()
        changed = [i for i in range(layout.num_layers) if not (old[i] == plan.phys_to_logical[i]).all()]
        if self.expert_weights is not None:
            for i in changed:
                stats.add(
                    shuffle_layer(
                        self.expert_weights[i],
                        old[i],
                        plan.phys_to_logical[i],
                        self.group,
                        self.config.p2p_groups,
                    )
                )
        layout.apply(plan.phys_to_logical)
        moved = torch.tensor([stats.bytes_received], dtype=torch.int64, device=self.expert_count.device)
        if dist.is_initialized() and layout.ep_size > 1:
            dist.all_reduce(moved, group=self.group)

        def imbalance(p2l) -> float:
            loads = rank_loads(tokens, p2l, layout.ep_size)
            return float(loads.amax(-1).sum() / loads.mean(-1).sum().clamp(min=1e-12))

        report = RebalanceReport(
            step=self.steps,
            imbalance_before=imbalance(old),
            imbalance_after=imbalance(plan.phys_to_logical),
            layers_changed=len(changed),
            shuffle=stats,
            bytes_moved_total=int(moved.item()),
            seconds=time.perf_counter() - start,
        )
        self.reports.append(report)
        end = time.perf_counter()
        for fn in self.listeners:
            fn("eplb_rebalance", start, end)
        if self.ep_rank == 0:
            logger.info(
                "EPLB step %d: peak/mean rank load %.3f -> %.3f, %d layers changed, %.1f MiB moved, %.3f s",
                report.step, report.imbalance_before, report.imbalance_after, report.layers_changed,
                report.bytes_moved_total / 2**20, report.seconds,
            )  # fmt: skip
        return report
