"""Device-side index builders of the graph-safe V4.1 decode step, keyed like the eager step's host planners.

`StaticDecodeMetadata.cached(key, ...)` builds these instead of the host planners of
`models.grouped_attention` (`window_keys._swa_index`, `attend._band_mask`, `entries._entry_index`,
`compress._new_entry_index`): one query per row, every shape fixed by the bucket, the window and the context
tier, nothing read back to the host.
"""

from __future__ import annotations

import torch

from ... import batch_invariant
from ...runtime.static_metadata import StaticDecodeMetadata
from ...runtime.step_view import entries_per_block


def _static_swa(meta: StaticDecodeMetadata, _group: int, window: int, floor: bool):
    """`grouped_attention.window_keys._swa_index` for one query per row: the band of a single query is its
    window, columns p - W + 1 .. p, clipped to [max(0, p - W + 1), p] (what the host planner computes for
    Q = 1)."""
    if floor:
        raise ValueError("the graph-safe decode step does not run YOCO truncation")
    p = meta.positions[:, None]
    if batch_invariant.enabled():
        # the eager layout (`grouped_attention.window_keys._swa_index`): whole key tiles aligned to absolute
        # positions, so a key sits in the same tile column as there; one fixed width covers any window start
        # (W + KT - 1)
        lo = (p - window + 1).clamp(min=0)
        start = lo - lo % batch_invariant.KEY_TILE
        width = batch_invariant.key_tiles(window + batch_invariant.KEY_TILE - 1)
        k_pos = start + torch.arange(width, device=meta.device)[None, :]
        visible = (k_pos >= lo) & (k_pos <= p)
        return meta.dev_token_slots(torch.minimum(torch.maximum(k_pos, lo), p)), visible, None, None, None
    start = p - window + 1
    pos = torch.clamp(
        start + torch.arange(window, device=meta.device)[None, :], min=start.clamp(min=0), max=p
    )
    return meta.dev_token_slots(pos), None, None, None, None


def _static_band(
    meta: StaticDecodeMetadata, kind: str, _group: int, window: int, floor: bool, a: int, b: int
):
    """`grouped_attention.attend._band_mask` [G, 1, 1, W] for Q = 1: column c (position p - W + 1 + c) is
    visible iff it is at least 0 (it always lies in the window and at or below p)."""
    if kind != "swa" or floor or a != 0 or b != 1:
        raise ValueError(f"graph-safe decode: unexpected band request {(kind, window, floor, a, b)}")
    start = meta.positions[:, None] - window + 1
    visible = start + torch.arange(window, device=meta.device)[None, :] >= 0
    return visible[:, None, None, :]


def _static_comp(meta: StaticDecodeMetadata, _group: int, ratio: int):
    """`grouped_attention.entries._entry_index` over `max_entries(ratio)` columns: entry j of a query at p is
    real and visible iff j < (p + 1) // ratio; the rest re-read entry min(j, n - 1) and are zeroed /
    masked."""
    width = meta.max_entries(ratio)
    # whole key tiles, entry j in column j (`grouped_attention.entries._entry_index`)
    if batch_invariant.enabled():
        width = batch_invariant.key_tiles(width)
    n = torch.div(meta.positions + 1, ratio, rounding_mode="floor")[:, None]
    j = torch.arange(width, device=meta.device)[None, :]
    safe_j = torch.minimum(j, (n - 1).clamp(min=0))
    valid = j < n
    return meta.dev_entry_slots(safe_j, ratio), (~valid)[..., None], valid


def _static_new(meta: StaticDecodeMetadata, ratio: int):
    """`grouped_attention.compress._new_entry_index` with a fixed shape: every query's current block
    j = p // ratio is compressed; a block that is not complete after this token (p + 1 not a multiple of the
    ratio) is written to the dummy block's first entry slot instead of its own, which nothing reads as valid.
    With 1 + k rows per sequence, each block that completes in the step completes at exactly one row
    (its last token), so every completed block is written once, as in the eager step."""
    p = meta.positions
    j = torch.div(p, ratio, rounding_mode="floor")
    own = meta.dev_entry_slots(j, ratio)
    if ratio == 1:  # every token is its own (complete) block: the rows of x, in order
        return meta.rows_index, p, own
    complete = (p + 1) % ratio == 0
    dummy = torch.full_like(own, meta.dummy_block * entries_per_block(meta.block_size, ratio))
    tokens = j[:, None] * ratio + torch.arange(ratio, device=meta.device)[None, :]
    return meta.dev_token_slots(tokens).reshape(-1), j * ratio, torch.where(complete, own, dummy)


STATIC_INDEX = {"swa": _static_swa, "band": _static_band, "comp": _static_comp, "new": _static_new}
