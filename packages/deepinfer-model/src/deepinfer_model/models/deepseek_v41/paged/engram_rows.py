"""Engram table rows of a step's packed tokens (eager), and of one query per row (graph-safe)."""

from __future__ import annotations

import numpy as np
import torch

from ....runtime.metadata import StepMetadata
from ....runtime.pools import TOKEN_IDS, PagedKVCache
from ....runtime.static_metadata import StaticDecodeMetadata
from ...grouped_attention import (
    ranges,
)
from ..engram_hash import engram_hash
from ..model import DeepseekV41ForCausalLM


def _engram_rows(model: DeepseekV41ForCausalLM, meta: StepMetadata, cache: PagedKVCache) -> dict:
    """Engram table rows of the packed tokens, all sequences in one hash per layer.

    Each sequence contributes a window: `N-1` context slots (earlier tokens from `token_ids`, or the
    compressed pad where the sequence has none, which is what the n-gram context holds before a
    sequence start) followed by its query tokens. Windows are concatenated; an n-gram never reaches
    back more than `N-1` slots, so none crosses into another sequence's window.
    """
    eng = model.engram
    back = eng.cfg.max_ngram_size - 1
    starts, ends, qlens = meta.starts, meta.ends, meta.query_lens
    lo = np.maximum(starts - back, 0)
    seq, pos = ranges(lo, ends)
    ids = cache.read(TOKEN_IDS, meta.dev(meta.token_slots_of(seq, pos))).reshape(-1)
    window = back + qlens
    base = np.concatenate(([0], np.cumsum(window)[:-1]))  # window start of each sequence
    flat = torch.full((int(window.sum()),), eng.vocab.pad_id, dtype=torch.long, device=meta.device)
    flat[meta.dev(base[seq] + back + pos - starts[seq])] = eng.vocab.compress(ids)
    _, query = ranges(base + back, base + window)
    query = meta.dev(query)
    return {
        layer: engram_hash(flat, eng.layout, layer, eng.multipliers[layer], eng.vocab.pad_id)[query]
        for layer in eng.cfg.layer_ids
    }


def _static_engram_rows(
    model: DeepseekV41ForCausalLM, meta: StaticDecodeMetadata, cache: PagedKVCache
) -> dict:
    """`_engram_rows` for one query per sequence with fixed shapes: each sequence's window is the N-1
    positions before its token and the token (pad where the position is negative), read from
    `token_ids` (this step's token is written there first)."""
    eng = model.engram
    back = eng.cfg.max_ngram_size - 1
    pos = meta.positions[:, None] - torch.arange(back, -1, -1, device=meta.device)[None, :]  # [N, back+1]
    ids = cache.read(TOKEN_IDS, meta.dev_token_slots(pos.clamp(min=0)).reshape(-1)).reshape(pos.shape)
    window = torch.where(pos >= 0, eng.vocab.compress(ids), eng.vocab.pad_id).reshape(-1)
    query = meta.rows_index * (back + 1) + back  # the token itself: last slot of its window
    return {
        layer: engram_hash(window, eng.layout, layer, eng.multipliers[layer], eng.vocab.pad_id)[query]
        for layer in eng.cfg.layer_ids
    }
