"""In-place expert weight shuffle after a new placement (engine spec §7.5, "Shuffle").

Per layer, each rank ends up with the weights of the logical expert its new slots name:

* a slot whose expert this rank already held is copied locally (from a staging copy of the old weights);
* an expert needed from elsewhere crosses the network once per receiving rank, over point-to-point
  sends; duplicate slots of that expert on the receiver copy the received tensor locally.

Senders of expert ``e`` are the ranks that held it (first slot each), receivers the ranks that need it
and did not hold it. With ``R`` receivers and ``S`` senders: if ``R < S`` receiver ``j`` uses sender ``j``;
otherwise receiver ``j < (R//S)*S`` uses sender ``j // (R//S)`` and the rest use senders 0, 1, 2, ...
Both sides compute the same pairing from the two maps, so no negotiation is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from deepinfer_cluster import envs


@dataclass(frozen=True)
class Transfer:
    expert: int
    src: int  # EP rank (index in the group)
    dst: int


@dataclass
class ShuffleStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    experts_received: int = 0
    local_copies: int = 0

    def add(self, other: ShuffleStats) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.experts_received += other.experts_received
        self.local_copies += other.local_copies


def transfer_plan(old_p2l, new_p2l, ep_size: int) -> list[Transfer]:
    """The cross-rank expert copies one layer's re-placement needs, in a canonical order (by expert)."""
    old = np.asarray(old_p2l).reshape(ep_size, -1)
    new = np.asarray(new_p2l).reshape(ep_size, -1)
    transfers = []
    for e in np.unique(new).tolist():
        holders = np.flatnonzero((old == e).any(axis=1)).tolist()
        if not holders:
            raise ValueError(f"expert {e} appears in the new placement but in no slot of the old one")
        needers = np.flatnonzero((new == e).any(axis=1)).tolist()
        receivers = [r for r in needers if r not in holders]
        n_recv, n_send = len(receivers), len(holders)
        per = n_recv // n_send
        for j, dst in enumerate(receivers):
            if n_recv < n_send:
                src = holders[j]
            elif j < per * n_send:
                src = holders[j // per]
            else:
                src = holders[j - per * n_send]
            transfers.append(Transfer(e, src, dst))
    return transfers


def p2p_groups() -> int:
    return envs.get("DEEPINFER_REARRANGE_P2P_GROUPS")


def shuffle_layer(
    weights: list[torch.Tensor],
    old_p2l,
    new_p2l,
    group: dist.ProcessGroup | None = None,
    num_p2p_groups: int | None = None,
) -> ShuffleStats:
    """Rewrite this rank's local expert tensors (each ``[slots_per_rank, ...]``) in place so that slot
    ``q`` holds logical expert ``new_p2l[rank*S + q]``. Collective over the EP ``group``."""
    ep_size, me = dist.get_world_size(group), dist.get_rank(group)
    old = np.asarray(old_p2l).reshape(ep_size, -1)
    new = np.asarray(new_p2l).reshape(ep_size, -1)
    per_rank = old.shape[1]
    for w in weights:
        if w.shape[0] != per_rank:
            raise ValueError(f"expert weight has {w.shape[0]} local slots, the layout has {per_rank}")
    stats = ShuffleStats()
    if np.array_equal(old, new):
        return stats
    groups = num_p2p_groups or p2p_groups()
    staged = [w.clone() for w in weights]
    old_mine, new_mine = old[me].tolist(), new[me].tolist()
    first_old = {e: q for q, e in reversed(list(enumerate(old_mine)))}

    transfers = transfer_plan(old, new, ep_size)
    received: dict[int, list[torch.Tensor]] = {}
    for bucket in range(groups):
        ops = []
        for t in transfers:
            if (t.dst - t.src) % ep_size % groups != bucket:
                continue
            for i, w in enumerate(staged):
                tag = t.expert * len(staged) + i
                if t.src == me:
                    peer = dist.get_global_rank(group, t.dst) if group is not None else t.dst
                    ops.append(dist.P2POp(dist.isend, w[first_old[t.expert]], peer, group, tag))
                    stats.bytes_sent += w[0].numel() * w.element_size()
                elif t.dst == me:
                    peer = dist.get_global_rank(group, t.src) if group is not None else t.src
                    buf = torch.empty_like(w[0])
                    received.setdefault(t.expert, []).append(buf)
                    ops.append(dist.P2POp(dist.irecv, buf, peer, group, tag))
                    stats.bytes_received += buf.numel() * buf.element_size()
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    stats.experts_received = len(received)

    with torch.no_grad():
        for q, e in enumerate(new_mine):
            if e in first_old:
                if first_old[e] != q or old_mine[q] != e:
                    stats.local_copies += 1
                for w, s in zip(weights, staged):
                    w[q].copy_(s[first_old[e]])
            else:
                for w, buf in zip(weights, received[e]):
                    w[q].copy_(buf)
    return stats
