"""The MoE load-balance statistic (engine spec §7.5, "Load-balance stat").

Each step records the tokens every MoE layer processed on this rank. Every ``interval`` steps the
records are all-gathered over the EP group and summarised as ``sum over (step, layer) of the max over
ranks`` and ``... of the mean over ranks``; ``moe_lb`` is their ratio (1.0 = perfectly balanced).

A flush is a collective that ordinary steps do not carry, so whoever times steps (the benchmarks)
registers a listener: it is called after each flush with ``("moe_lb_flush", start, end)``, both
``time.perf_counter()`` values of this process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from deepinfer_cluster import envs


class MoeLoadStats:
    def __init__(self, num_layers: int, interval: int | None = None, group=None, device="cpu"):
        if interval is None:
            interval = envs.get("DEEPINFER_MOE_LB_STAT_INTERVAL")
        if interval < 1:
            raise ValueError(f"the load-balance stat interval must be an integer >= 1, got {interval}")
        self.interval, self.group, self.device = interval, group, device
        self.buffer = torch.zeros(interval, num_layers, dtype=torch.float64, device=device)
        self.filled = 0
        self.sum_max = 0.0
        self.sum_mean = 0.0
        self.listeners: list[Callable[[str, float, float], None]] = []

    def add_listener(self, fn: Callable[[str, float, float], None]) -> None:
        """Call ``fn(kind, start, end)`` after every flush (once, however often it is added)."""
        if fn not in self.listeners:
            self.listeners.append(fn)

    def record(self, tokens_per_layer: torch.Tensor) -> None:
        """Add one step (``[layers]`` tokens on this rank); every ``interval`` steps, a collective."""
        self.buffer[self.filled] = tokens_per_layer.to(self.buffer)
        self.filled += 1
        if self.filled == self.interval:
            self.flush()

    def flush(self) -> None:
        start = time.perf_counter()
        steps = self.buffer[: self.filled]
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            parts = [torch.empty_like(steps) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, steps.contiguous(), group=self.group)
            per_rank = torch.stack(parts)  # [R, steps, layers]
        else:
            per_rank = steps.unsqueeze(0)
        self.sum_max += float(per_rank.amax(0).sum())
        self.sum_mean += float(per_rank.mean(0).sum())
        self.filled = 0
        end = time.perf_counter()
        for fn in self.listeners:
            fn("moe_lb_flush", start, end)

    @property
    def moe_lb(self) -> float:
        return self.sum_max / self.sum_mean if self.sum_mean > 0 else 1.0

    def reset(self) -> None:
        self.sum_max = self.sum_mean = 0.0
