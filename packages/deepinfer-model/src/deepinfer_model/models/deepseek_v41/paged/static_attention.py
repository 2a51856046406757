"""The graph-safe step's attention pieces: its one group, the top-k selected entries read with a fixed
shape, and the index scores restricted to candidate blocks."""

from __future__ import annotations

import numpy as np
import torch

from .... import batch_invariant
from ....layers.indexer import select_topk
from ....numerics import round_narrow
from ....runtime.pools import PagedKVCache
from ....runtime.static_metadata import StaticDecodeMetadata
from ...grouped_attention import (
    Group,
    grouped_index_scores,
    mark_pool_values,
)
from ..sparse import candidate_mask

KT = batch_invariant.KEY_TILE


def _static_selected(
    cache: PagedKVCache, meta: StaticDecodeMetadata, pool: str, ratio: int, selected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend`'s `extra` for the graph-safe step, reading only the top-k selected entries of every row
    (fixed shape [N, k, D]) from `pool` instead of every entry up to the context tier: the picked entries
    as each row's own entry list, and indices 0 .. k-1 into it (-1 kept). `attend` then gathers the same
    values the eager step gathers from the full entry list; an unselected (-1) column is zero here (the
    eager step re-reads entry 0 or its zero padding: either way finite, at zero probability)."""
    none = selected < 0
    slots = meta.dev_entry_slots(selected.clamp(min=0), ratio)  # [N, k]
    picked = cache.read(pool, slots).masked_fill(none[..., None], 0.0)  # [N, k, D]
    k = selected.shape[1]
    own = torch.arange(k, device=selected.device).expand_as(selected)
    return picked, torch.where(none, selected, own)


def _frame_tiles(entries: torch.Tensor, n_tiles: int, cap: int) -> torch.Tensor:
    """The distinct key tiles (entry // KEY_TILE) of each row's `entries` [N, m] (-1 = none), ascending,
    the first `cap` of them (a row has at most min(m, n_tiles)), `n_tiles` where a row has fewer: long
    [N, cap]. Device-only (two sorts, no unique)."""
    t = torch.where(entries >= 0, torch.div(entries, KT, rounding_mode="floor"), n_tiles)
    t = torch.sort(t, dim=1).values
    dup = torch.zeros_like(t, dtype=torch.bool)
    dup[:, 1:] = t[:, 1:] == t[:, :-1]
    t = torch.sort(t.masked_fill(dup, n_tiles), dim=1).values[:, :cap]
    if t.shape[1] < cap:
        t = torch.cat((t, t.new_full((t.shape[0], cap - t.shape[1]), n_tiles)), dim=1)
    return t


def _tile_entries(tiles: torch.Tensor) -> torch.Tensor:
    """Entry ids of whole key tiles `tiles` [N, T] -> [N, T * KEY_TILE] (tile order, then column)."""
    return (tiles[:, :, None] * KT + torch.arange(KT, device=tiles.device)).flatten(1)


def _static_candidate_topk(
    cache: PagedKVCache,
    meta: StaticDecodeMetadata,
    g: Group,
    pool: str,
    ratio: int,
    qi: torch.Tensor,
    head_w: torch.Tensor,
    candidates: torch.Tensor,
    topo,
    topk: int,
    act: torch.dtype,
) -> torch.Tensor:
    """Top-k of an index source restricted to candidate blocks (spec v41-model §4.6), graph-safe and with
    a fixed shape that follows the candidate capacity instead of the context tier: each row gathers the
    index keys of its candidate blocks only ([N, blocks x block_size], ascending entry ids), scores them
    and maps the compact top-k back to entry ids. The eager step scores every entry and masks all but
    the candidates' valid ones: the same scores of the same allowed entries, and ascending compact order
    is ascending entry order, so the tie rule (lower index first) picks the same entries."""
    block = topo.candidate_block_size
    entry = (candidates.clamp(min=0)[:, :, None] * block + torch.arange(block, device=meta.device)).flatten(1)
    klen = torch.div(meta.positions + 1, ratio, rounding_mode="floor")[:, None]
    if batch_invariant.enabled():
        # the eager layout: each entry in its own column of whole key tiles (ascending), the tiles that
        # hold a candidate entry only (at most 2 per candidate block of <= KEY_TILE entries)
        width = meta.cached(("comp", g.index, ratio), None)[2].shape[1]
        n_tiles = width // KT
        per = (block + KT - 2) // KT + 1  # tiles a run of `block` consecutive entries can touch
        listed = torch.where((candidates >= 0).repeat_interleave(block, dim=1), entry, -1)
        tiles = _frame_tiles(listed, n_tiles, min(candidates.shape[1] * per, n_tiles))
        entry = _tile_entries(tiles)
        cand = candidate_mask(candidates, width + KT, block)
        allowed = cand.gather(1, entry.clamp(max=width + KT - 1)) & (entry < klen)
        keys = cache.read(pool, meta.dev_entry_slots(entry.clamp(max=width - 1), ratio))
        keys = mark_pool_values(cache, pool, keys.masked_fill(~allowed[..., None], 0.0))
        scores = round_narrow(grouped_index_scores(qi, keys, head_w, g, False, act), act)
        local = select_topk(scores, allowed, topk)
        return torch.where(local >= 0, entry.gather(1, local.clamp(min=0)), local)
    allowed = (candidates >= 0).repeat_interleave(block, dim=1) & (entry < klen)
    keys = cache.read(pool, meta.dev_entry_slots(entry, ratio)).masked_fill(~allowed[..., None], 0.0)
    scores = round_narrow(grouped_index_scores(qi, keys, head_w, g, False, act), act)
    local = select_topk(scores, allowed, topk)
    return torch.where(local >= 0, entry.gather(1, local.clamp(min=0)), local)


def _static_groups(meta: StaticDecodeMetadata) -> list[Group]:
    """The one group of a static step: every row (query token) is a one-query sequence (no padding
    slots); a verification step's 1 + k rows of a sequence read the same pools at their own positions."""
    rows = meta.rows_index
    n = rows.shape[0]
    qmask = torch.ones(n, 1, dtype=torch.bool, device=meta.device)
    return [Group(np.arange(n), rows[:, None], qmask, meta.positions[:, None], 0, packed_rows=rows)]
