"""Continue an overlapping compressor (public V4 CSA) for one sequence across steps.

Non-overlapping compressors are continued for all sequences at once (`grouped_attention.compress_new`); CSA's
entries also pool the previous block, so they are continued per sequence whose block completes.
"""

from __future__ import annotations

import torch

from ..config import RopeSpec
from ..layers.compressor import Compressed, CompressorWeights, compress
from ..numerics import carrier
from ..runtime.metadata import StepMetadata
from ..runtime.pools import PagedKVCache


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
        x = torch.cat((old, x.to(carrier())))
    prev = None
    if overlap and b0:
        prev, x = x[:ratio], x[ratio:]
    return first, compress(x, w, ratio, overlap, rope, eps, b0, act_dtype, prev_block=prev)
