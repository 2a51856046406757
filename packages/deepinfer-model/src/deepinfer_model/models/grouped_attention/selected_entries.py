"""Top-k selected compressed entries per query slot: read directly from the pool, and batch-invariant
mode's layout of them (shared entry tiles for short contexts, each slot's own keys for long ones)."""

from __future__ import annotations

import torch

from ... import batch_invariant
from ...layers.indexer import selection_mask
from ...runtime.pools import PagedKVCache
from ...runtime.step_view import StepView
from .entries import _entry_index, entry_validity
from .groups import Group
from .pool_values import mark_pool_values


def _own_columns(selected: torch.Tensor, gq: tuple[int, int]):
    """Batch-invariant mode: where each query slot's own keys come from, for a group [G, Q] and its
    top-k selection [G*Q, k] (-1 = none): (entry index [G*Q, Ko] in `own_order`, 0 where none; none
    bool [G*Q, Ko]; each slot's sequence [G*Q, 1])."""
    order = batch_invariant.own_order(selected)
    seq = torch.arange(gq[0], device=selected.device).repeat_interleave(gq[1])[:, None]
    return order.clamp(min=0), order < 0, seq


def own_entries(entries: torch.Tensor, selected: torch.Tensor, gq: tuple[int, int]):
    """Batch-invariant mode: the own keys of each query slot of a group [G, Q] from its entries [G, n, D]
    and top-k selection [G*Q, k] (-1 = none): the selected entries in `own_order`, zero where none ->
    (keys [G*Q, Ko, D], visible bool [G*Q, Ko]), marked FP32-valued where `entries` is."""
    j, none, seq = _own_columns(selected, gq)
    keys = entries[seq, j].masked_fill_(none[..., None], 0.0)  # (a gathered copy)
    if batch_invariant.marked_fp32_valued(entries):
        batch_invariant.mark_fp32_valued(keys)
    return keys, ~none


def selected_entries(cache: PagedKVCache, meta: StepView, g: Group, pool: str, ratio: int, selected):
    """`own_entries` read from `pool` directly (only the selected entries, not every entry of the group):
    the same values, since an entry is read from the same slot. `selected` [G*Q, k] per query slot; the
    graph-safe step (one query per row) maps entries to slots on the device."""
    j, none, seq = _own_columns(selected, g.rows.shape)
    if meta.graph_safe:
        slots = meta.dev_entry_slots(j, ratio)
    else:
        entry_slots = meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))[0]  # [G, n]
        slots = entry_slots[seq, j]
    keys = cache.read(pool, slots).masked_fill_(none[..., None], 0.0)  # (read returns a gathered copy)
    return mark_pool_values(cache, pool, keys), ~none


def invariant_selection(
    cache: PagedKVCache, meta: StepView, g: Group, pool: str, ratio: int, selected: torch.Tensor
):
    """Batch-invariant mode: the top-k selected entries of a group's query slots (`selected` [G*Q, k])
    laid out by how many entries each slot can see, a function of the slot alone (so its bits do not
    depend on its neighbours): at most `batch_invariant.SHARED_ENTRY_COLS` -> columns of its sequence's
    first entry tiles, shared by the sequence's queries (`attend`'s bool `extra`); more -> its own keys
    (`selected_entries`, `attend`'s `own`). Why both: a short-context prefill chunk's queries share a few
    entry tiles (one read), where own keys would copy k entries per query (measured on the CPU: +17% per
    64-token prefill step at batch 8 with own keys only, +13% with this layout); a long context's query
    sees hundreds of entries of which it selected k. A query's part in the layout it does not use is all
    invisible: +0 partials and -inf scores, which change no bit. -> (extra or None, own or None), extra =
    (entry tiles, bool selected, bool selectable: a superset `attend` plans the tiles from). The threshold
    depends on the device (`batch_invariant.shared_entry_cols`: off the CPU, own keys only); where it is
    not 0 the graph-safe step always gets both (fixed shapes)."""
    static = meta.graph_safe
    cols = batch_invariant.shared_entry_cols(selected.device)
    if cols == 0:  # every query takes own keys
        return None, selected_entries(cache, meta, g, pool, ratio, selected)
    valid = entry_validity(meta, g, ratio)  # [G*Q, width]
    if static:  # one query per row: its sequence's entries are the ones it sees
        short = valid.sum(dim=-1) <= cols
        any_short = any_long = True
    else:  # decided on the host (no device sync): a slot at p sees (p + 1) // ratio entries

        def make():  # once per step and group (every layer of this ratio shares it)
            host_q = g.host_q_pos if g.host_q_pos is not None else g.q_pos.cpu().numpy()
            host_short = (host_q.reshape(-1) + 1) // ratio <= cols
            return bool(host_short.any()), not bool(host_short.all()), meta.dev(host_short)

        any_short, any_long, short = meta.cached(("bi_short", g.index, ratio, cols), make)
    extra = own = None
    if any_short:
        width = min(valid.shape[1], cols)
        if static:
            j = torch.arange(width, device=valid.device).expand(valid.shape[0], width)
            slots, padding = meta.dev_entry_slots(j, ratio), ~valid[:, :width, None]
        else:
            slots, padding, _ = meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))
            slots, padding = slots[:, :width], padding[:, :width]
        keys = mark_pool_values(cache, pool, cache.read(pool, slots).masked_fill_(padding, 0.0))
        seen = selection_mask(torch.where(short[:, None], selected, -1), width)
        # what a short slot may select (known on the host): `attend` plans its tiles from it once per step,
        # so the selection itself is never read back (a device sync per layer on the GPU)
        if static:  # (computes every tile: no plan)
            extra = (keys, seen)
        else:
            may = meta.cached(("bi_may", g.index, ratio, cols), lambda: valid[:, :width] & short[:, None])
            extra = (keys, seen, may)
    if any_long:
        keys, visible = selected_entries(cache, meta, g, pool, ratio, selected)
        own = (keys, visible & ~short[:, None])
    return extra, own
