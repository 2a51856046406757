"""The cached pieces every model shares: continue a compressor across steps, gather a query's keys.

Each function works on one sequence `i` of the packed step (a per-sequence loop in the model, never a
per-token one) and reproduces exactly what the stateless forward computes for those positions.
"""

from __future__ import annotations

import torch

from ..config import RopeSpec
from ..layers.attention import compressed_visible, sliding_window_visible
from ..layers.compressor import Compressed, CompressorWeights, compress
from .metadata import StepMetadata
from .pools import PagedKVCache


def new_entries(
    cache: PagedKVCache,
    meta: StepMetadata,
    i: int,
    hidden_pool: str | None,
    x: torch.Tensor,
    w: CompressorWeights,
    ratio: int,
    overlap: bool,
    rope: RopeSpec,
    eps: float,
    act_dtype: torch.dtype,
) -> tuple[int, Compressed] | None:
    """Compressed entries that complete during this step for sequence `i`: (first entry id, entries).

    `x` [q, H] are this step's compressor inputs of the sequence; the tokens of the still-incomplete
    block before them (and, with `overlap`, the block before that) come from `hidden_pool`, where
    earlier steps stored them. `compress` restarts at the block boundary, so the result is bitwise the
    stateless forward's entries.
    """
    start, end = int(meta.starts[i]), int(meta.ends[i])
    first, last = start // ratio, end // ratio
    if last == first:
        return None
    b0 = first * ratio
    past = b0 - ratio if (overlap and b0) else b0
    if past < start:
        old = cache.read(hidden_pool, meta.token_slots(i, past, start))
        x = torch.cat((old, x.double()))
    prev = None
    if overlap and b0:
        prev, x = x[:ratio], x[ratio:]
    return first, compress(x, w, ratio, overlap, rope, eps, b0, act_dtype, prev_block=prev)


def swa_keys(cache: PagedKVCache, meta: StepMetadata, i: int, pool: str, window: int):
    """(keys [S, D], visible [q, S]) of the sliding window of sequence `i`'s queries."""
    start, end = int(meta.starts[i]), int(meta.ends[i])
    lo = max(0, start - window + 1)
    q_pos = meta.positions[meta.rows(i)]
    keys = cache.read(pool, meta.token_slots(i, lo, end))
    return keys, sliding_window_visible(q_pos, torch.arange(lo, end), window)


def compressed_entries(cache: PagedKVCache, meta: StepMetadata, i: int, pool: str, ratio: int):
    """(entries [n, d], visible [q, n]) of every compressed entry sequence `i` has after this step."""
    n = int(meta.ends[i]) // ratio
    entries = cache.read(pool, meta.entry_slots(i, 0, n, ratio))
    return entries, compressed_visible(meta.positions[meta.rows(i)], n, ratio)
