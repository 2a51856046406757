"""Compressed entries completed in a step, for every non-overlapping compressor at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import RopeSpec
from ...layers.compressor import CompressorWeights, compress
from ...layers.rope import apply_rope, cos_sin
from ...numerics import round_to
from ...runtime.metadata import StepMetadata
from ...runtime.pools import PagedKVCache
from ...runtime.step_view import StepView
from .ranges import ranges


@dataclass
class NewEntries:
    """Compressed entries completed in this step, over all sequences."""

    slots: torch.Tensor  # long [n] entry-pool slots
    pre_rope: torch.Tensor  # [n, D] normed latent (index keys are projected from it)
    keys: torch.Tensor  # [n, D] with RoPE at the entry position
    positions: torch.Tensor  # long [n] entry position j * ratio


def compress_new(
    cache: PagedKVCache,
    meta: StepView,
    hidden_pool: str | None,
    x: torch.Tensor,
    w: CompressorWeights,
    ratio: int,
    rope: RopeSpec,
    eps: float,
    act_dtype: torch.dtype,
) -> NewEntries | None:
    """Entries of every block (non-overlapping compressor) that completes in this step, in one call.

    Block j pools tokens j*r .. j*r+r-1; those before this step come from `hidden_pool`, which must
    already hold this step's inputs too (ratio 1 needs no pool: every token is its own block).
    """
    index = meta.cached(("new", ratio), lambda: _new_entry_index(meta, ratio))
    if index is None:
        return None
    gather, positions, slots = index
    blocks_x = x[gather] if ratio == 1 else cache.read(hidden_pool, gather)
    pre_rope = compress(blocks_x, w, ratio, False, rope, eps, 0, act_dtype).pre_rope
    cos, sin = cos_sin(rope, positions)
    keys = round_to(apply_rope(pre_rope, cos, sin), act_dtype)  # the compressor's own rotation step
    return NewEntries(slots, pre_rope, keys, positions)


def _new_entry_index(meta: StepMetadata, ratio: int):
    """(rows of x (ratio 1) or token slots of the pooled blocks, entry positions, entry slots) on the
    step's device; None when no block completes in this step."""
    first, last = meta.starts // ratio, meta.ends // ratio
    seq, j = ranges(first, last)
    if len(j) == 0:
        return None
    if ratio == 1:
        gather = meta.dev(meta.offsets[seq] + j - meta.starts[seq])
    else:
        tok_seq, pos = ranges(first * ratio, last * ratio)
        gather = meta.dev(meta.token_slots_of(tok_seq, pos))
    return gather, meta.dev(j * ratio), meta.dev(meta.entry_slots_of(seq, j, ratio))
