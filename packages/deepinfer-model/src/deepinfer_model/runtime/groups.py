"""Batched (padded) views of a step's sequences, so attention runs per group of sequences, not per sequence.

Sequences are bucketed by query length (decodes with decodes, verification blocks with each other,
similar prefill chunks together); a group's queries are padded to its longest, its key sets to its
longest context, and attention is one batched computation per group. Every gather below is one
vectorised numpy / torch indexing operation: the Python work per layer is per group, never per token
or per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import batch_invariant
from ..config import RopeSpec
from ..layers.compressor import CompressorWeights, compress
from ..layers.rope import apply_rope, cos_sin
from ..numerics import carrier, round_to
from .metadata import StepMetadata
from .pools import PagedKVCache

SCORE_BLOCK_ELEMENTS = 1 << 27  # FP64 attention scores held at once by `attend` (1 GiB)


def ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flatten the integer ranges [lo[k], hi[k]) -> (range index of each element, element value)."""
    n = np.maximum(hi - lo, 0)
    owner = np.repeat(np.arange(len(lo)), n)
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return owner, lo[owner] + within


@dataclass
class Group:
    """Sequences attended together, queries padded to the longest: row-major [G, Q] query slots.

    A padding slot repeats its sequence's last real query (same row, same position), so everything
    computed for it is a finite duplicate that is simply never written back.
    """

    seqs: np.ndarray  # sequence indices in the step
    rows: torch.Tensor  # long [G, Q] packed row of each query slot
    qmask: torch.Tensor  # bool [G, Q] real query slots
    q_pos: torch.Tensor  # long [G, Q] absolute positions
    index: int = 0  # the group's number in its step (keys the step's cached index tensors)

    @property
    def slot_rows(self) -> torch.Tensor:
        """Packed row of every query slot, padding included: long [G*Q]."""
        return self.rows.reshape(-1)

    @property
    def packed_rows(self) -> torch.Tensor:
        """Packed rows of the real query slots, in [G, Q] row-major order."""
        return self.rows[self.qmask]


def make_groups(meta: StepMetadata) -> list[Group]:
    """Bucket sequences by query length (lengths in (2^(k-1), 2^k] share a bucket), so padding at most
    doubles a group's query slots: decodes batch with decodes, equal prefill chunks with each other."""
    active = np.flatnonzero(meta.query_lens > 0)  # a sequence with no query tokens attends to nothing
    bucket = np.ceil(np.log2(meta.query_lens[active])).astype(np.int64)
    groups = []
    for k in np.unique(bucket):
        seqs = active[bucket == k]
        qlen = meta.query_lens[seqs]
        slot = np.arange(int(qlen.max()))[None, :]
        host_rows = meta.offsets[seqs][:, None] + np.minimum(slot, qlen[:, None] - 1)
        rows = meta.dev(host_rows)
        groups.append(Group(seqs, rows, meta.dev(slot < qlen[:, None]), meta.positions[rows], len(groups)))
    return groups


def swa_keys(
    cache: PagedKVCache, meta: StepMetadata, g: Group, pool: str, window: int, floor: np.ndarray | None = None
):
    """(keys [G, S, D], visible [G*Q, S]): each query's sliding window, read from `pool`.

    `floor` [G] (YOCO truncation): no key below it is visible; those keys may never have been stored, so
    they are zeroed (a masked key must still be finite: attention multiplies it by a zero probability).
    """
    # index tensors depend on the group, window and floor only: built and sent once per step, reused by
    # every layer of that window
    slots, visible, below = meta.cached(
        ("swa", g.index, window, floor is not None), lambda: _swa_index(meta, g, window, floor)
    )
    keys = cache.read(pool, slots)
    if below is not None:
        # zero by the position actually read: padding columns re-read position hi - 1, which may lie
        # below the floor (never stored) even where the column's nominal position does not
        keys = keys.masked_fill(below, 0.0)
    return keys, visible


def _swa_index(meta: StepMetadata, g: Group, window: int, floor: np.ndarray | None):
    lo = np.maximum(meta.starts[g.seqs] - window + 1, 0)
    hi = meta.ends[g.seqs]
    if batch_invariant.enabled():  # whole key tiles aligned to absolute positions (a key's column is fixed)
        start, width = batch_invariant.aligned_span(lo, hi)
    else:
        start, width = lo, int((hi - lo).max())
    # columns below lo (alignment) or from hi (padding) are invisible; they re-read a stored key
    pos = np.clip(start[:, None] + np.arange(width)[None, :], lo[:, None], hi[:, None] - 1)
    slots = meta.dev(meta.token_slots_of(g.seqs[:, None], pos))
    k_pos = meta.dev(start[:, None] + np.arange(width)[None, :])[:, None, :]
    q_pos = g.q_pos[:, :, None]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)  # k_pos <= q_pos < hi also drops padding
    below = None
    if floor is not None:
        f = np.asarray(floor, dtype=np.int64)[:, None]
        visible = visible & (k_pos >= meta.dev(f)[:, :, None])
        below = meta.dev(pos < f)[..., None]
    return slots, visible.reshape(-1, width), below


def compressed_entries(cache: PagedKVCache, meta: StepMetadata, g: Group, pool: str, ratio: int):
    """(entries [G, n, d], valid [G*Q, n]): every entry each sequence has after this step; entry j is
    valid for a query at p iff j < (p + 1) // ratio (its block is complete). Padding entries are zero
    (a masked key must still be finite: attention multiplies it by a zero probability)."""
    slots, padding, valid = meta.cached(("comp", g.index, ratio), lambda: _entry_index(meta, g, ratio))
    return cache.read(pool, slots).masked_fill(padding, 0.0), valid


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


def attend(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, g: Group, sinks, scale
) -> torch.Tensor:
    """Sink attention (as `layers.attention.sink_attention`, batched over the group's sequences, each
    with its own shared key set): packed `q` [N, nh, D], `keys` [G, S, D], `visible` [G*Q, S]
    -> FP64 [rows, nh, D] for `g.packed_rows`."""
    gq = g.rows.shape
    if batch_invariant.enabled():  # keys laid out in aligned tiles by swa_keys / compressed_entries
        out = batch_invariant.sink_attention(q[g.rows], keys, visible.view(*gq, -1), sinks, scale)
        return out[g.qmask]
    keys = keys.to(carrier())
    vis = visible.view(*gq, 1, -1)
    # Long prefill chunks: the [G, Q, nh, S] FP64 scores of a 16k-token chunk over 16k keys would take
    # 128 GiB, so queries go in blocks that keep them near SCORE_BLOCK_ELEMENTS (each query row's result
    # does not depend on the others in its block).
    per_query = gq[0] * q.shape[1] * keys.shape[1]
    block = max(1, SCORE_BLOCK_ELEMENTS // max(per_query, 1))
    outs = []
    for lo in range(0, gq[1], block):
        rows = g.rows[:, lo : lo + block]
        qs = q[rows].to(carrier())  # [G, q, nh, D]
        scores = torch.einsum("gqhd,gsd->gqhs", qs, keys) * scale
        scores = scores.masked_fill(~vis[:, lo : lo + block], float("-inf"))
        sink = sinks.to(carrier())[None, None, :, None].expand(*rows.shape, -1, 1)
        logits = torch.cat((scores, sink), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        outs.append(torch.einsum("gqhs,gsd->gqhd", probs, keys))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out[g.qmask]


def grouped_index_scores(qi: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, g: Group, scaled: bool):
    """Index scores [G*Q, n] (as `layers.indexer.index_scores`, batched over the group's sequences):
    packed `qi` [N, n_i, d_i] and `head_w` [N, n_i] against each sequence's index keys [G, n, d_i]."""
    n_heads, head_dim = qi.shape[1], qi.shape[2]
    if batch_invariant.enabled():  # fixed-shape dot products (entries padded to whole tiles)
        gq = g.rows.shape
        flat = qi[g.rows].reshape(gq[0], -1, head_dim)
        s = torch.relu(batch_invariant.tiled_scores(flat, keys).view(*gq, n_heads, -1))
    else:  # query blocks, as in `attend`: a long chunk's [G, Q, n_i, n] scores would not fit
        keys = keys.to(carrier())
        block = max(1, SCORE_BLOCK_ELEMENTS // max(g.rows.shape[0] * n_heads * keys.shape[1], 1))
        out = []
        for lo in range(0, g.rows.shape[1], block):
            rows = g.rows[:, lo : lo + block]
            s = torch.relu(torch.einsum("gqhd,gnd->gqhn", qi[rows].to(carrier()), keys))
            w = head_w[rows].to(carrier())
            if scaled:
                s = s * head_dim**-0.5
                w = w * n_heads**-0.5
            out.append((s * w.unsqueeze(-1)).sum(dim=2))
        return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).reshape(-1, keys.shape[1])
    w = head_w[g.rows].double()
    if scaled:
        s = s * head_dim**-0.5
        w = w * n_heads**-0.5
    return (s * w.unsqueeze(-1)).sum(dim=2).reshape(-1, keys.shape[1])


@dataclass
class NewEntries:
    """Compressed entries completed in this step, over all sequences."""

    slots: torch.Tensor  # long [n] entry-pool slots
    pre_rope: torch.Tensor  # [n, D] normed latent (index keys are projected from it)
    keys: torch.Tensor  # [n, D] with RoPE at the entry position
    positions: torch.Tensor  # long [n] entry position j * ratio


def compress_new(
    cache: PagedKVCache,
    meta: StepMetadata,
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
