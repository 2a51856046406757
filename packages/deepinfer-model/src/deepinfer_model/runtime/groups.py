"""Batched (padded) views of a step's sequences, so attention runs per group of sequences, not per sequence.

Sequences with short queries (decodes, verification blocks, small chunks) form one group padded to the
longest of them; each longer prefill chunk is a group of its own (no padding waste, and its compute
dwarfs the Python overhead). Every gather below is one vectorised numpy / torch indexing operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import RopeSpec
from ..layers.attention import sink_attention
from ..layers.compressor import CompressorWeights, compress
from ..layers.indexer import index_scores
from ..layers.rope import apply_rope, cos_sin
from ..numerics import round_to
from .metadata import StepMetadata
from .pools import PagedKVCache

SHORT_QUERY = 16  # queries up to this many tokens share one padded group


def ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flatten the integer ranges [lo[k], hi[k]) -> (range index of each element, element value)."""
    n = np.maximum(hi - lo, 0)
    owner = np.repeat(np.arange(len(lo)), n)
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return owner, lo[owner] + within


@dataclass
class Group:
    seqs: np.ndarray  # sequence indices in the step
    rows: torch.Tensor  # long [G, Q] packed row of each (sequence, query slot); padding repeats a real row
    qmask: torch.Tensor  # bool [G, Q] real query slots
    q_pos: torch.Tensor  # long [G, Q] absolute positions (padding: a real row's position)

    @property
    def packed_rows(self) -> torch.Tensor:
        """Packed rows of the real query slots, in [G, Q] row-major order."""
        return self.rows[self.qmask]


def make_groups(meta: StepMetadata) -> list[Group]:
    short = np.flatnonzero(meta.query_lens <= SHORT_QUERY)
    parts = ([short] if len(short) else []) + [
        np.array([i]) for i in np.flatnonzero(meta.query_lens > SHORT_QUERY)
    ]
    groups = []
    for seqs in parts:
        qlen = meta.query_lens[seqs]
        width = int(qlen.max())
        slot = np.arange(width)[None, :]
        mask = slot < qlen[:, None]
        rows = meta.offsets[seqs][:, None] + np.minimum(slot, qlen[:, None] - 1)
        rows_t = torch.from_numpy(rows)
        groups.append(Group(seqs, rows_t, torch.from_numpy(mask), meta.positions[rows_t]))
    return groups


def swa_keys(cache: PagedKVCache, meta: StepMetadata, g: Group, pool: str, window: int):
    """(keys [G, S, D], visible [rows, S]): each query's sliding window, read from `pool`."""
    lo = np.maximum(meta.starts[g.seqs] - window + 1, 0)
    hi = meta.ends[g.seqs]
    width = int((hi - lo).max())
    pos = np.minimum(lo[:, None] + np.arange(width)[None, :], hi[:, None] - 1)
    keys = cache.read(pool, torch.from_numpy(meta.token_slots_of(g.seqs[:, None], pos)))
    k_pos = torch.from_numpy(lo[:, None] + np.arange(width)[None, :])[:, None, :]
    q_pos = g.q_pos[:, :, None]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)  # k_pos <= q_pos < hi also drops padding
    return keys, visible[g.qmask]


def compressed_entries(cache: PagedKVCache, meta: StepMetadata, g: Group, pool: str, ratio: int):
    """(entries [G, n, d], valid [rows, n]): every entry each sequence has after this step; entry j is
    valid for a query at p iff j < (p + 1) // ratio (its block is complete). Padding entries are zero
    (a masked key must still be finite: attention multiplies it by a zero probability)."""
    n = meta.ends[g.seqs] // ratio
    width = max(int(n.max()), 1)
    j = np.arange(width)[None, :]
    entries = cache.read(
        pool,
        torch.from_numpy(
            meta.entry_slots_of(g.seqs[:, None], np.minimum(j, np.maximum(n[:, None] - 1, 0)), ratio)
        ),
    )
    entries = entries.masked_fill(torch.from_numpy(j >= n[:, None])[..., None], 0.0)
    valid = torch.arange(width)[None, None, :] < torch.div(
        g.q_pos[:, :, None] + 1, ratio, rounding_mode="floor"
    )
    return entries, valid[g.qmask]


def per_row(t: torch.Tensor, g: Group) -> torch.Tensor:
    """A per-sequence tensor [G, ...] repeated for each real query row -> [rows, ...]."""
    return t[:, None].expand(-1, g.rows.shape[1], *t.shape[1:])[g.qmask]


def attend(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, g: Group, sinks, scale
) -> torch.Tensor:
    """Sink attention of the group's real queries (`q` packed [N, nh, D], `visible` [rows, S])
    -> FP64 [rows, nh, D] in `g.packed_rows` order."""
    if len(g.seqs) == 1:  # one sequence: its keys are shared by all its queries
        return sink_attention(q[g.packed_rows], keys[0], visible, sinks, scale)
    return sink_attention(q[g.packed_rows], per_row(keys, g), visible, sinks, scale)


def grouped_index_scores(qi: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, g: Group, scaled: bool):
    """Index scores [rows, n] of the group's queries (packed `qi` [N, n_i, d_i], `head_w` [N, n_i])
    against each sequence's index keys [G, n, d_i]; same formula as `layers.indexer.index_scores`."""
    rows = g.packed_rows
    if len(g.seqs) == 1:
        return index_scores(qi[rows], keys[0], head_w[rows], scaled)
    n_heads, head_dim = qi.shape[1], qi.shape[2]
    s = torch.relu(torch.einsum("thd,tnd->thn", qi[rows].double(), per_row(keys, g).double()))
    w = head_w[rows].double()
    if scaled:
        s = s * head_dim**-0.5
        w = w * n_heads**-0.5
    return (s * w.unsqueeze(-1)).sum(dim=1)


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
    first, last = meta.starts // ratio, meta.ends // ratio
    seq, j = ranges(first, last)
    if len(j) == 0:
        return None
    if ratio == 1:
        blocks_x = x[torch.from_numpy(meta.offsets[seq] + j - meta.starts[seq])]
    else:
        tok_seq, pos = ranges(first * ratio, last * ratio)
        blocks_x = cache.read(hidden_pool, torch.from_numpy(meta.token_slots_of(tok_seq, pos)))
    pre_rope = compress(blocks_x, w, ratio, False, rope, eps, 0, act_dtype).pre_rope
    positions = torch.from_numpy(j * ratio)
    cos, sin = cos_sin(rope, positions)
    keys = round_to(apply_rope(pre_rope, cos, sin), act_dtype)  # the compressor's own rotation step
    slots = torch.from_numpy(meta.entry_slots_of(seq, j, ratio))
    return NewEntries(slots, pre_rope, keys, positions)
