"""Where keys sit in the mode's attention: tiles of `KEY_TILE` columns aligned to a frame that depends on
the key only (`aligned_span`, `key_tiles`), and a query's own top-k selected keys in an order that depends
on its selected set only (`own_layout`, `own_order`)."""

from __future__ import annotations

import numpy as np
import torch

KEY_TILE = 32  # key columns per attention tile (a multiple of every SIMD width: no scalar tail in exp)


# ------------------------------------------------------------------------------------------ attention
def key_tiles(n: int) -> int:
    """Columns of a key segment of `n` keys rounded up to whole tiles (at least one tile)."""
    return max(-(-int(n) // KEY_TILE), 1) * KEY_TILE


def aligned_span(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, int]:
    """(start [G], width) of key columns for key positions [lo, hi) per sequence: each start aligned
    down to a multiple of `KEY_TILE` (so column c of tile t always holds the same absolute position),
    one width, in whole tiles, that covers every sequence."""
    lo = np.asarray(lo, dtype=np.int64)
    start = lo - lo % KEY_TILE
    return start, key_tiles(int((np.asarray(hi) - start).max()))


# on the CPU, a top-k selected entry of a query that sees at most this many compressed entries is a column
# of its sequence's first entry tiles, else one of the query's own keys (`models.grouped_attention.invariant_selection`)
SHARED_ENTRY_COLS = 2 * KEY_TILE


def shared_entry_cols(device: torch.device) -> int:
    """The `SHARED_ENTRY_COLS` threshold on `device`: on the CPU the constant (own keys copy k entries per
    query of a prefill chunk: +17.5% vs +13% per batch-8 prefill step); elsewhere 0, every query takes own
    keys: a GPU copies them at memory speed, and the graph-safe decode step, which cannot skip a layout,
    would compute both for every row (measured on the H200: graphed decode +10% / +12% at batch 1 / 8 with
    own keys only, +17% / +19% with both). Bits are compared on one device, so each may lay them out its
    own way."""
    return SHARED_ENTRY_COLS if torch.device(device).type == "cpu" else 0


OWN_COLS = 8  # a query's own (top-k selected) key list is padded to a multiple of this many columns


def own_layout(k: int) -> tuple[int, int]:
    """(tile columns, total columns) of a query's own key list for a top-k of `k` entries: `k` rounded up
    to a multiple of `OWN_COLS`, in tiles of at most `KEY_TILE` columns (whole tiles)."""
    width = -(-max(int(k), 1) // OWN_COLS) * OWN_COLS
    tile = min(KEY_TILE, width)
    return tile, -(-width // tile) * tile


def own_order(selected: torch.Tensor) -> torch.Tensor:
    """Top-k selections [R, k] (entry ids, -1 = none) -> [R, `own_layout(k)[1]`]: each row's entries in
    ascending order, then -1 (none) to the full width. The column of a selected entry in its query's own
    key list: a function of the selected set only (the order `select_topk` returned does not matter)."""
    k = selected.shape[-1]
    width = own_layout(k)[1]
    big = torch.iinfo(selected.dtype).max
    out = torch.sort(torch.where(selected < 0, big, selected), dim=-1).values
    out = torch.where(out == big, -1, out)
    if width > k:
        out = torch.cat((out, out.new_full((*out.shape[:-1], width - k), -1)), dim=-1)
    return out
