"""Context parallelism for prefill: the balanced "mirror" (zig-zag) split and its inverse.

For each sequence of length ``L``: ``ps = ceil(L / (2*cp))``; the sequence is cut into ``2*cp`` pieces
of ``ps`` tokens (the tail padded) and rank ``r`` owns pieces ``r`` and ``2*cp-1-r``. Under causal
attention an early piece is cheap and a late one expensive, so pairing them balances the work.
Every rank gets the same number of rows, ``2 * sum(ps)``, which makes the all-gather uniform.
Padding rows carry index ``-1`` (``valid`` false).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class MirrorSplit:
    """Where this rank's rows come from. ``index`` is the row in the flat (concatenated) batch or -1;
    ``positions`` the position inside its sequence (-1 for padding); ``seq_ids`` the sequence."""

    cp_size: int
    rank: int
    seq_lens: list[int]
    index: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return self.index >= 0

    @property
    def local_len(self) -> int:
        return self.index.numel()


def _check(seq_lens: list[int], cp_size: int, rank: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {cp_size!r}")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, cp_size={cp_size}), got {rank}")
    if any(n < 0 for n in seq_lens):
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens}")


def mirror_split_plan(seq_lens: list[int], cp_size: int, rank: int, device=None) -> MirrorSplit:
    """The rows rank ``rank`` owns under the mirror split of sequences with lengths ``seq_lens``."""
    seq_lens = [int(n) for n in seq_lens]
    _check(seq_lens, cp_size, rank)
    index, positions, seq_ids = [], [], []
    start = 0
    for sid, length in enumerate(seq_lens):
        ps = -(-length // (2 * cp_size))
        for piece in (rank, 2 * cp_size - 1 - rank):
            pos = torch.arange(piece * ps, (piece + 1) * ps)
            ok = pos < length
            positions.append(torch.where(ok, pos, -1))
            index.append(torch.where(ok, pos + start, -1))
            seq_ids.append(torch.full((ps,), sid))
        start += length
    cat = (lambda xs: torch.cat(xs).to(device)) if index else (lambda xs: torch.zeros(0, dtype=torch.int64))
    return MirrorSplit(cp_size, rank, seq_lens, cat(index), cat(positions), cat(seq_ids))


def mirror_split(
    tokens: torch.Tensor, seq_lens: list[int], cp_size: int, rank: int
) -> tuple[torch.Tensor, MirrorSplit]:
    """This rank's rows of ``tokens [sum(seq_lens), ...]`` (padding rows are zero) and the plan."""
    if tokens.shape[0] != sum(seq_lens):
        raise ValueError(f"tokens has {tokens.shape[0]} rows but sum(seq_lens) = {sum(seq_lens)}")
    plan = mirror_split_plan(seq_lens, cp_size, rank, device=tokens.device)
    local = tokens[plan.index.clamp(min=0)].clone()
    local[~plan.valid] = 0
    return local, plan


def reverse_index(seq_lens: list[int], cp_size: int) -> torch.Tensor:
    """For each original row, its row in the concatenation of all ranks' shards (rank order)."""
    total = sum(seq_lens)
    rev = torch.empty(total, dtype=torch.int64)
    offset = 0
    for r in range(cp_size):
        plan = mirror_split_plan(seq_lens, cp_size, r)
        ok = plan.valid
        rev[plan.index[ok]] = torch.nonzero(ok).flatten() + offset
        offset += plan.local_len
    return rev


def restore_order(gathered: torch.Tensor, seq_lens: list[int], cp_size: int) -> torch.Tensor:
    """Original order ``[sum(seq_lens), ...]`` from the rank-ordered concatenation of all shards."""
    rev = reverse_index(seq_lens, cp_size).to(gathered.device)
    return gathered[rev]


def all_gather_restore(
    local: torch.Tensor, plan: MirrorSplit, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather every rank's shard (e.g. K/V, or final hidden states) and restore the original order.

    Each rank then holds the full sequence-ordered tensor: the KV its queries attend to is a prefix of
    it (causal), selected by ``plan.positions``/``plan.seq_ids``.
    """
    if local.shape[0] != plan.local_len:
        raise ValueError(f"local has {local.shape[0]} rows, the plan has {plan.local_len}")
    shards = [torch.empty_like(local) for _ in range(plan.cp_size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return restore_order(torch.cat(shards), plan.seq_lens, plan.cp_size)
