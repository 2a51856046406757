"""Compressed entries of each sequence of a group, and which of them each query slot sees."""

from __future__ import annotations

import numpy as np
import torch

from ... import batch_invariant
from ...runtime.metadata import StepMetadata
from ...runtime.pools import PagedKVCache
from ...runtime.step_view import StepView
from .groups import Group
from .pool_values import mark_pool_values


def compressed_entries(cache: PagedKVCache, meta: StepView, g: Group, pool: str, ratio: int):
    """(entries [G, n, d], valid [G*Q, n]): every entry each sequence has after this step; entry j is
    valid for a query at p iff j < (p + 1) // ratio (its block is complete). Padding entries are zero
    (a masked key must still be finite: attention multiplies it by a zero probability)."""
    slots, padding, valid = meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))
    return mark_pool_values(cache, pool, cache.read(pool, slots).masked_fill(padding, 0.0)), valid


def _entry_index(meta: StepMetadata, g: Group, ratio: int):
    n = meta.ends[g.seqs] // ratio
    width = batch_invariant.key_tiles(n.max()) if batch_invariant.enabled() else max(int(n.max()), 1)
    j = np.arange(width)[None, :]
    safe_j = np.minimum(j, np.maximum(n[:, None] - 1, 0))
    slots = meta.dev(meta.entry_slots_of(g.seqs[:, None], safe_j, ratio))
    padding = meta.dev(j >= n[:, None])[..., None]
    valid = torch.arange(width, device=meta.device)[None, None, :] < torch.div(
        g.q_pos[:, :, None] + 1, ratio, rounding_mode="floor"
    )
    return slots, padding, valid.reshape(-1, width)


def entry_validity(meta: StepView, g: Group, ratio: int) -> torch.Tensor:
    """The `valid` [G*Q, n] of `compressed_entries` without reading the entries."""
    return meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))[2]
