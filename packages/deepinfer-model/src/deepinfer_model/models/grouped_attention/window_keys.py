"""Each query's sliding window of keys, read from the window pool in one gather per group."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ... import batch_invariant
from ...runtime.metadata import StepMetadata
from ...runtime.pools import PagedKVCache
from ...runtime.step_view import StepView
from .groups import Group
from .pool_values import mark_pool_values


@dataclass
class WindowKeys:
    """A group's sliding-window keys, as `swa_keys` reads them.

    Default layout (`visible` None): column c of sequence i holds position `base[i] + c`, with
    `base = start - window + 1` the same offset for every sequence, so query slot s (nominal position
    start + s) sees exactly columns s .. s + window - 1 and a block of B query slots sees B + window - 1
    contiguous columns: `attend` scores only that band, O(Q * window) instead of O(Q * (Q + window)).
    Columns outside [max(base, 0), end) re-read a stored key and are never visible.

    Batch-invariant layout (`visible` set): whole aligned key tiles and the full [G*Q, S] mask, for
    `batch_invariant.sink_attention`.
    """

    keys: torch.Tensor  # [G, S, D]
    window: int
    visible: torch.Tensor | None = None  # bool [G*Q, S], batch-invariant layout only
    index_key: tuple = ()  # keys the step's cached band masks (group, window, floor)
    base: np.ndarray | None = None  # int64 [G] position of column 0 (default layout)
    low: np.ndarray | None = None  # int64 [G] lowest visible position: max(0, floor)


def swa_keys(
    cache: PagedKVCache, meta: StepView, g: Group, pool: str, window: int, floor: np.ndarray | None = None
) -> WindowKeys:
    """Each query's sliding window of keys, read from `pool` (see `WindowKeys` for the layout).

    `floor` [G] (YOCO truncation): no key below it is visible; those keys may never have been stored, so
    they are zeroed (a masked key must still be finite: attention multiplies it by a zero probability).
    """
    if window < 1:
        raise ValueError(f"sliding window = {window} must be >= 1")
    # index tensors depend on the group, window and floor only: built and sent once per step, reused by
    # every layer of that window
    key = ("swa", g.index, window, floor is not None)
    slots, visible, below, base, low = meta.cached(key, lambda: _swa_index(meta, g, window, floor))
    keys = cache.read(pool, slots)
    if below is not None:
        # zero by the position actually read: padding columns re-read position hi - 1, which may lie
        # below the floor (never stored) even where the column's nominal position does not
        keys = keys.masked_fill(below, 0.0)
    return WindowKeys(mark_pool_values(cache, pool, keys), window, visible, key, base, low)


def _swa_index(meta: StepMetadata, g: Group, window: int, floor: np.ndarray | None):
    lo = np.maximum(meta.starts[g.seqs] - window + 1, 0)
    hi = meta.ends[g.seqs]
    low = lo if floor is None else np.maximum(lo, np.asarray(floor, dtype=np.int64))
    if batch_invariant.enabled():  # whole key tiles aligned to absolute positions (a key's column is fixed)
        start, width = batch_invariant.aligned_span(lo, hi)
    else:  # the band layout: same column offset for every sequence (see `WindowKeys`)
        start, width = meta.starts[g.seqs] - window + 1, g.rows.shape[1] + window - 1
    # columns below lo (alignment, band) or from hi (padding) are invisible; they re-read a stored key
    pos = np.clip(start[:, None] + np.arange(width)[None, :], lo[:, None], hi[:, None] - 1)
    slots = meta.dev(meta.token_slots_of(g.seqs[:, None], pos))
    below = None if floor is None else meta.dev(pos < np.asarray(floor, dtype=np.int64)[:, None])[..., None]
    if not batch_invariant.enabled():
        return slots, None, below, start, low
    k_pos = meta.dev(start[:, None] + np.arange(width)[None, :])[:, None, :]
    q_pos = g.q_pos[:, :, None]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)  # k_pos <= q_pos < hi also drops padding
    if floor is not None:
        visible = visible & (k_pos >= meta.dev(np.asarray(floor, dtype=np.int64)[:, None])[:, :, None])
    return slots, visible.reshape(-1, width), below, start, low
