"""The EPLB planner: a pure function from a routing trace to a new expert placement.

Objective (engine spec §7.5), per layer and in parallel for all layers: minimise the sum over the
window's steps of the most loaded *replica* (phase 1, replication) and then of the most loaded *rank*
(phase 2, placement). A replica's load is its expert's tokens divided by the expert's replica count,
because the replica rule spreads a rank's rows evenly over the replicas.

``rebalance`` never returns a plan worse than the current placement on the trace it was given: per
layer it keeps whichever of (new plan, current placement) has the lower summed per-step peak rank
load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..layout import initial_phys_to_logical, logical_maps

_TIE = 1e-4  # makes per-replica loads distinct so the argmax is unique (lowest expert id wins ties)


@dataclass
class EplbPlan:
    """``phys_to_logical [L, P]``, ``logical_to_physical [L, E, max_replicas]`` (-1 padded),
    ``replica_count [L, E]``; slots ``[r*S, (r+1)*S)`` live on rank ``r``."""

    phys_to_logical: np.ndarray
    logical_to_physical: np.ndarray
    replica_count: np.ndarray
    num_ranks: int


def _check_trace(tokens, num_physical: int, num_ranks: int) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(tokens) if not torch.is_tensor(tokens) else tokens)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3:
        raise ValueError(
            f"tokens must be [window, layers, experts] (or [layers, experts]), got {tuple(t.shape)}"
        )
    num_logical = t.shape[2]
    if num_physical < num_logical:
        raise ValueError(f"num_replicas={num_physical} must be >= number of experts {num_logical}")
    if num_ranks < 1 or num_physical % num_ranks:
        raise ValueError(f"num_replicas={num_physical} must be divisible by num_ranks={num_ranks}")
    if (t < 0).any():
        raise ValueError("tokens must be >= 0")
    return t.to(torch.float64)


def replicate(tokens: torch.Tensor, num_physical: int) -> torch.Tensor:
    """Phase 1. ``tokens [W, L, E]`` -> ``phys_to_logical [L, P]`` in slot order (identity, then one
    slot per added replica). Each added replica goes to the expert whose extra copy lowers
    ``sum_t max_e load[t, e] / count[e]`` most (lowest expert id on ties)."""
    w, num_layers, num_logical = tokens.shape
    num_extra = num_physical - num_logical
    layers = torch.arange(num_layers)
    extra = torch.empty(num_layers, num_extra, dtype=torch.int64)
    if num_extra == 0:
        return torch.arange(num_logical).expand(num_layers, num_logical).clone()
    tie = _TIE * torch.arange(num_logical, dtype=torch.float64)
    # Loads only fall when a replica is added, and each round adds one replica per layer, so after
    # i rounds the top two of a step lie among its i+2 initially largest experts: track only those.
    k = min(num_extra + 2, num_logical)
    cand_load, cand = (tokens + tie).topk(k, dim=-1)  # [W, L, K], tie-broken loads at count 1
    cand_raw = tokens.gather(-1, cand)
    # Where each expert sits among a step's candidates (-1: not a candidate), to update it in place.
    slot_of = torch.full((w, num_layers, num_logical), -1, dtype=torch.int64)
    slot_of.scatter_(-1, cand, torch.arange(k).expand(w, num_layers, k))
    per_replica = cand_load.clone()  # [W, L, K] tie-broken per-replica loads
    count = torch.ones(num_layers, num_logical, dtype=torch.float64)
    lw = layers.unsqueeze(0)  # [1, L]
    for i in range(num_extra):
        peak, first = per_replica.max(dim=-1)  # [W, L]; max returns the first index on ties
        first = first.unsqueeze(-1)
        if k > 1:
            per_replica.scatter_(-1, first, -1.0)  # hide the maximum to read the second largest
            second = per_replica.amax(-1)
            per_replica.scatter_(-1, first, peak.unsqueeze(-1))
        else:
            second = torch.zeros_like(peak)
        hot = cand.gather(-1, first).squeeze(-1)  # expert ids [W, L]
        after = torch.maximum(second, cand_raw.gather(-1, first).squeeze(-1) / (count[lw, hot] + 1))
        gain = torch.zeros(num_layers, num_logical, dtype=torch.float64)
        gain.scatter_add_(1, hot.T, (peak - after).T)
        best = torch.argmax(gain, dim=1)  # argmax returns the first (lowest id) on ties
        extra[:, i] = best
        count[layers, best] += 1
        pos = slot_of[:, layers, best]  # [W, L]
        present = (pos >= 0).unsqueeze(-1)
        pos = pos.clamp(min=0).unsqueeze(-1)
        fresh = cand_load.gather(-1, pos) / count[layers, best].view(1, -1, 1)
        per_replica.scatter_(-1, pos, torch.where(present, fresh, per_replica.gather(-1, pos)))
    base = torch.arange(num_logical).expand(num_layers, num_logical)
    return torch.cat([base, extra], dim=1)


def place(tokens: torch.Tensor, slots: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Phase 2. Put the slots of ``slots [L, P]`` (logical ids) on ranks, heaviest replica first, each
    on the rank with free capacity that least raises ``sum_t max_r load[t, r]`` (lowest rank
    id on ties). Returns the new
    ``phys_to_logical [L, P]`` (rank ``r`` owns positions ``[r*S, (r+1)*S)``)."""
    w, num_layers, num_logical = tokens.shape
    num_physical = slots.shape[1]
    per_rank = num_physical // num_ranks
    if per_rank == 1:
        return slots.clone()
    count = torch.zeros(num_layers, num_logical, dtype=torch.float64)
    count.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.float64))
    per_replica = tokens.permute(1, 2, 0) / count.unsqueeze(-1)  # [L, E, W]
    v = per_replica.gather(1, slots.unsqueeze(-1).expand(-1, -1, w)).float()  # [L, P, W]
    order = torch.argsort(-v.sum(-1), dim=1, stable=True)
    v = v.gather(1, order.unsqueeze(-1).expand(-1, -1, w))  # heaviest first
    ordered_slots = slots.gather(1, order)
    layers = torch.arange(num_layers)
    load = torch.zeros(num_layers, num_ranks, w)
    peak = torch.zeros(num_layers, 1, w)
    buf = torch.empty_like(load)
    score = torch.empty(num_layers, num_ranks)
    fill = torch.zeros(num_layers, num_ranks, dtype=torch.int64)
    out = torch.empty(num_layers, num_ranks, per_rank, dtype=torch.int64)
    for i in range(num_physical):
        vp = v[:, i].unsqueeze(1)  # [L, 1, W]
        torch.add(load, vp, out=buf)
        torch.maximum(buf, peak, out=buf)
        torch.sum(buf, dim=-1, out=score)  # [L, R]: sum_t max(peak, load + v) if placed on r
        score.masked_fill_(fill >= per_rank, float("inf"))
        r = torch.argmin(score, dim=1)  # argmin returns the first (lowest rank id) on ties
        placed = load[layers, r] + vp.squeeze(1)
        load[layers, r] = placed
        torch.maximum(peak, placed.unsqueeze(1), out=peak)
        out[layers, r, fill[layers, r]] = ordered_slots[:, i]
        fill[layers, r] += 1
    return out.reshape(num_layers, num_physical)


def rank_loads(tokens, phys_to_logical, num_ranks: int) -> torch.Tensor:
    """Per-step rank loads ``[W, L, R]`` of a placement, with tokens split evenly over replicas."""
    t = torch.as_tensor(tokens, dtype=torch.float64)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if torch.is_tensor(phys_to_logical):
        p2l = phys_to_logical.detach().cpu().long()
    else:
        p2l = torch.from_numpy(np.array(phys_to_logical, dtype=np.int64))
    if p2l.dim() == 1:
        p2l = p2l.expand(t.shape[1], -1)
    num_layers, num_physical = p2l.shape
    count = torch.zeros(num_layers, t.shape[2], dtype=torch.float64)
    count.scatter_add_(1, p2l, torch.ones_like(p2l, dtype=torch.float64))
    per_replica = t / count  # [W, L, E]
    slot_load = per_replica.gather(2, p2l.unsqueeze(0).expand(t.shape[0], -1, -1))  # [W, L, P]
    return slot_load.reshape(t.shape[0], num_layers, num_ranks, num_physical // num_ranks).sum(-1)


def peak_sum(tokens, phys_to_logical, num_ranks: int) -> torch.Tensor:
    """``sum_t max_r load[t, l, r]`` per layer: the quantity the planner minimises."""
    return rank_loads(tokens, phys_to_logical, num_ranks).amax(-1).sum(0)


def rebalance(
    tokens,
    num_replicas: int,
    num_ranks: int,
    current: np.ndarray | torch.Tensor | None = None,
    max_window_steps: int | None = None,
) -> EplbPlan:
    """Plan a placement from ``tokens [window, layers, experts]`` (token counts per logical expert).

    ``num_replicas`` is the number of physical slots (experts + redundant), ``num_ranks`` the EP size.
    ``current`` (``phys_to_logical [layers, P]``, default: the initial placement) is kept for any layer
    where the plan would not lower the summed per-step peak rank load. ``max_window_steps`` optionally
    sums consecutive steps into at most that many buckets before planning (faster, coarser).
    """
    t = _check_trace(tokens, num_replicas, num_ranks)
    w, num_layers, num_logical = t.shape
    plan_t = t
    if max_window_steps is not None and w > max_window_steps:
        buckets = torch.arange(w) * max_window_steps // w
        plan_t = torch.zeros(max_window_steps, num_layers, num_logical, dtype=t.dtype).index_add_(
            0, buckets, t
        )
    p2l = place(plan_t, replicate(plan_t, num_replicas), num_ranks)
    if current is None:
        cur = torch.from_numpy(initial_phys_to_logical(num_logical, num_replicas)).expand(num_layers, -1)
    else:
        cur = torch.as_tensor(np.asarray(current), dtype=torch.int64)
        if tuple(cur.shape) != (num_layers, num_replicas):
            raise ValueError(
                f"current must be [layers={num_layers}, num_replicas={num_replicas}], got {tuple(cur.shape)}"
            )
    keep = peak_sum(t, cur, num_ranks) <= peak_sum(t, p2l, num_ranks)
    p2l = torch.where(keep.unsqueeze(1), cur, p2l).numpy().copy()
    l2p, counts = logical_maps(p2l, num_logical, num_replicas - num_logical + 1)
    return EplbPlan(p2l, l2p, counts, num_ranks)


def greedy_rebalance(tokens, num_replicas: int, num_ranks: int) -> EplbPlan:
    """A simple baseline on the window's *summed* load: give each extra replica to the expert with the
    highest per-replica load, then place replicas heaviest first on the least loaded rank with room."""
    t = _check_trace(tokens, num_replicas, num_ranks).sum(0)  # [L, E]
    num_layers, num_logical = t.shape
    per_rank = num_replicas // num_ranks
    layers = np.arange(num_layers)
    total = t.numpy()
    count = np.ones((num_layers, num_logical))
    slots = [np.tile(np.arange(num_logical), (num_layers, 1))]
    for _ in range(num_replicas - num_logical):
        best = np.argmax(total / count, axis=1)
        count[layers, best] += 1
        slots.append(best[:, None])
    slots = np.concatenate(slots, axis=1)
    weight = total[layers[:, None], slots] / count[layers[:, None], slots]
    order = np.argsort(-weight, axis=1, kind="stable")
    load = np.zeros((num_layers, num_ranks))
    fill = np.zeros((num_layers, num_ranks), dtype=np.int64)
    out = np.empty((num_layers, num_ranks, per_rank), dtype=np.int64)
    for i in range(num_replicas):
        p = order[:, i]
        r = np.argmin(np.where(fill >= per_rank, np.inf, load), axis=1)
        load[layers, r] += weight[layers, p]
        out[layers, r, fill[layers, r]] = slots[layers, p]
        fill[layers, r] += 1
    p2l = out.reshape(num_layers, num_replicas)
    l2p, counts = logical_maps(p2l, num_logical, num_replicas - num_logical + 1)
    return EplbPlan(p2l, l2p, counts, num_ranks)
