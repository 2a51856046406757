"""MoE expert parallelism: dispatch tokens to the ranks that own their experts, combine results back.

This is the torch.distributed all-to-all backend (gloo on CPU, NCCL on GPU); it is always available.
The shared expert is not routed: the model computes it locally and adds it to the result.

Each (token, top-k choice) pair is sent as its own row; a token choosing two experts on one rank is
sent twice. That costs bandwidth compared with DeepEP's per-rank deduplication but keeps the
combine a plain weighted sum in the token's own rank, in a fixed order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import LayerExpertLayout

# local_expert_fn(local_slot, tokens[n, hidden]) -> outputs[n, hidden]; local_slot in [0, slots_per_rank).
LocalExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def slot_ranges(rows_per_slot: list[int]):
    """`(slot, lo, hi)` of every local slot with rows, for rows grouped slot after slot (both backends)."""
    lo = 0
    for slot, n in enumerate(rows_per_slot):
        if n:
            yield slot, lo, lo + n
        lo += n


def _all_to_all(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits, group=group)
    return out


@dataclass
class AllToAllHandle:
    """What `combine` needs to send a dispatch's rows back: the send order and split sizes."""

    order: torch.Tensor  # (token, choice) rows in destination-rank order
    token_of_row: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    group: dist.ProcessGroup | None


def dispatch(
    hidden: torch.Tensor, physical: torch.Tensor, slots_per_rank: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor, AllToAllHandle]:
    """Send one row per (token, choice) to the rank owning its physical slot (``physical [T, k]``).
    Returns ``(rows [N, H], local_slot [N], handle)``; one host sync (the split sizes)."""
    ep_size = dist.get_world_size(group)
    top_k = physical.shape[1]
    flat = physical.reshape(-1)
    dest = flat // slots_per_rank
    order = torch.argsort(dest, stable=True)  # rows grouped by destination rank
    send_counts = torch.bincount(dest, minlength=ep_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    token_of_row = order // top_k
    rows = _all_to_all(hidden[token_of_row], send_splits, recv_splits, group)
    slots = _all_to_all((flat[order] % slots_per_rank).unsqueeze(1), send_splits, recv_splits, group).squeeze(
        1
    )
    return rows, slots, AllToAllHandle(order, token_of_row, send_splits, recv_splits, group)


def combine(
    rows: torch.Tensor, handle: AllToAllHandle, topk_weights: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Send the expert outputs back and sum ``w[t,k] * out`` per token, in a fixed order: ``[T, H]``."""
    back = _all_to_all(rows, handle.recv_splits, handle.send_splits, handle.group)
    weights = topk_weights.reshape(-1)[handle.order].to(back.dtype).unsqueeze(1)
    out = torch.zeros((num_tokens, rows.shape[1]), dtype=back.dtype, device=rows.device)
    out.index_add_(0, handle.token_of_row, back * weights)
    return out


def dispatch_combine(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    local_expert_fn: LocalExpertFn,
    layout: LayerExpertLayout,
    group: dist.ProcessGroup | None = None,
    expert_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert output ``sum_k w[t,k] * expert_{ids[t,k]}(hidden[t])`` for this rank's tokens.

    ``hidden [T, H]``, ``topk_ids [T, k]`` (logical ids), ``topk_weights [T, k]``. Collective over the
    EP ``group`` (every member must call it, also with ``T == 0``). ``expert_count [slots_per_rank]``,
    if given, gets the number of rows each local physical slot processed added to it (EPLB stats).
    """
    if hidden.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"expected hidden [T, H], topk_ids and topk_weights [T, k]; got {tuple(hidden.shape)}, "
            f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    ep_size = dist.get_world_size(group)
    if ep_size != layout.ep_size:
        raise ValueError(f"layout is for ep_size={layout.ep_size} but the group has {ep_size} ranks")
    s = layout.slots_per_rank
    physical = layout.physical_of(topk_ids, dist.get_rank(group))
    recv_hidden, recv_slot, handle = dispatch(hidden, physical, s, group)

    # Rows grouped by local slot with one stable sort: each slot's rows are contiguous and in arrival
    # order (the same matrix per slot as selecting them one slot at a time), and one host sync reads the
    # per-slot counts (one per slot before: a host-bound step on a GPU).
    by_slot = torch.argsort(recv_slot, stable=True)
    slot_rows = torch.bincount(recv_slot, minlength=s)
    if expert_count is not None:
        expert_count += slot_rows.to(expert_count.dtype)
    grouped = recv_hidden[by_slot]
    grouped_out = torch.zeros_like(grouped)
    for slot, lo, hi in slot_ranges(slot_rows.tolist()):
        grouped_out[lo:hi] = local_expert_fn(slot, grouped[lo:hi]).to(grouped.dtype)
    recv_out = torch.empty_like(grouped_out)
    recv_out[by_slot] = grouped_out

    return combine(recv_out, handle, topk_weights, hidden.shape[0]).to(hidden.dtype)
