"""Logical vs physical experts: where each replica lives and which replica a token uses.

``E`` logical experts (the router's ids) are stored in ``P = E + X`` physical slots, ``X`` of them
redundant replicas. EP rank ``r`` holds the contiguous slots ``[r*S, (r+1)*S)`` with ``S = P / ep``.
Maps are kept per MoE layer and updated *in place* by EPLB, so that anything holding a reference
(captured CUDA graphs, the model) sees the new placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Spreads a rank's rows over the replicas of an expert (engine spec §7.3, model spec §6.5).
REPLICA_ROW_STRIDE = 23333


def initial_phys_to_logical(num_logical: int, num_physical: int) -> np.ndarray:
    """Slots ``0..E-1`` hold experts ``0..E-1``; redundant slot ``E+i`` holds expert ``i mod E``."""
    return np.arange(num_physical, dtype=np.int64) % num_logical


def logical_maps(
    phys_to_logical: np.ndarray, num_logical: int, max_replicas: int
) -> tuple[np.ndarray, np.ndarray]:
    """From ``phys_to_logical [..., P]`` build ``logical_to_physical [..., E, max_replicas]`` (-1 padded,
    replicas in increasing slot order) and ``replica_count [..., E]``."""
    p2l = np.asarray(phys_to_logical, dtype=np.int64)
    lead, num_physical = p2l.shape[:-1], p2l.shape[-1]
    flat = p2l.reshape(-1, num_physical)
    rows = flat.shape[0]
    counts = np.zeros((rows, num_logical), dtype=np.int64)
    np.add.at(counts, (np.arange(rows)[:, None], flat), 1)
    if counts.min(initial=1) < 1:
        raise ValueError("every logical expert needs at least one physical slot")
    if counts.max(initial=0) > max_replicas:
        raise ValueError(f"an expert has {counts.max()} replicas, more than max_replicas={max_replicas}")
    # Stable sort by logical id keeps slots of one expert in increasing order.
    order = np.argsort(flat, axis=1, kind="stable")
    sorted_logical = np.take_along_axis(flat, order, axis=1)
    starts = np.cumsum(counts, axis=1) - counts
    rank_in_expert = np.arange(num_physical)[None, :] - np.take_along_axis(starts, sorted_logical, axis=1)
    l2p = np.full((rows, num_logical, max_replicas), -1, dtype=np.int64)
    l2p[np.arange(rows)[:, None], sorted_logical, rank_in_expert] = order
    return l2p.reshape(*lead, num_logical, max_replicas), counts.reshape(*lead, num_logical)


@dataclass
class LayerExpertLayout:
    """Views into one layer's maps, plus the EP geometry ``dispatch_combine`` needs."""

    phys_to_logical: torch.Tensor  # [P]
    logical_to_physical: torch.Tensor  # [E, max_replicas], -1 padded
    replica_count: torch.Tensor  # [E]
    ep_size: int
    slots_per_rank: int

    @property
    def num_physical(self) -> int:
        return self.phys_to_logical.numel()

    def physical_of(self, topk_ids: torch.Tensor, ep_rank: int) -> torch.Tensor:
        """Map router output (logical ids ``[T, k]``) to physical slots with the spec's replica rule:
        ``replica = (ep_rank + row*23333) mod replica_count[e]``, ``row`` = the token's row in this
        rank's batch."""
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device, dtype=torch.int64).unsqueeze(1)
        ids = topk_ids.long()
        replica = (ep_rank + rows * REPLICA_ROW_STRIDE) % self.replica_count[ids]
        return self.logical_to_physical[ids, replica]


class RedundantExpertLayout:
    """Per-layer placement of ``num_logical`` experts in ``num_logical + num_redundant`` slots over
    ``ep_size`` ranks, starting from the spec's initial placement (identical for all layers)."""

    def __init__(
        self,
        num_logical: int,
        num_redundant: int,
        ep_size: int,
        num_layers: int = 1,
        device: str | torch.device = "cpu",
    ):
        for name, value, low in (("num_logical", num_logical, 1), ("num_redundant", num_redundant, 0),
                                 ("ep_size", ep_size, 1), ("num_layers", num_layers, 1)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        num_physical = num_logical + num_redundant
        if num_physical % ep_size:
            raise ValueError(
                f"num_logical + num_redundant = {num_logical} + {num_redundant} = {num_physical} "
                f"must be divisible by ep_size={ep_size} (see num_redundant_experts)"
            )
        self.num_logical, self.num_redundant = num_logical, num_redundant
        self.num_physical, self.ep_size, self.num_layers = num_physical, ep_size, num_layers
        self.slots_per_rank = num_physical // ep_size
        self.max_replicas = num_redundant + 1
        p2l = np.broadcast_to(initial_phys_to_logical(num_logical, num_physical), (num_layers, num_physical))
        l2p, counts = logical_maps(p2l, num_logical, self.max_replicas)
        self.phys_to_logical = torch.tensor(np.ascontiguousarray(p2l), device=device)
        self.logical_to_physical = torch.tensor(l2p, device=device)
        self.replica_count = torch.tensor(counts, device=device)

    def layer(self, index: int) -> LayerExpertLayout:
        return LayerExpertLayout(
            self.phys_to_logical[index], self.logical_to_physical[index], self.replica_count[index],
            self.ep_size, self.slots_per_rank,
        )  # fmt: skip

    def rank_of_physical(self, physical: int | torch.Tensor):
        return physical // self.slots_per_rank

    def local_slots(self, ep_rank: int) -> range:
        return range(ep_rank * self.slots_per_rank, (ep_rank + 1) * self.slots_per_rank)

    def local_logical(self, layer: int, ep_rank: int) -> list[int]:
        """Logical expert held by each local slot of ``ep_rank`` (which weights to load)."""
        s = self.local_slots(ep_rank)
        return self.phys_to_logical[layer, s.start : s.stop].tolist()

    def apply(self, phys_to_logical: np.ndarray | torch.Tensor) -> None:
        """Adopt a new ``phys_to_logical [layers, P]`` in place (after the weights were shuffled)."""
        p2l = np.asarray(phys_to_logical.cpu() if torch.is_tensor(phys_to_logical) else phys_to_logical)
        if p2l.shape != tuple(self.phys_to_logical.shape):
            raise ValueError(f"phys_to_logical shape {p2l.shape} != {tuple(self.phys_to_logical.shape)}")
        l2p, counts = logical_maps(p2l, self.num_logical, self.max_replicas)
        self.phys_to_logical.copy_(torch.from_numpy(p2l))
        self.logical_to_physical.copy_(torch.from_numpy(l2p))
        self.replica_count.copy_(torch.from_numpy(counts))
