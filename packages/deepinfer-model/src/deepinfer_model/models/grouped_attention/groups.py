"""Groups of sequences attended together (bucketed by query length, queries padded to the longest) and
the query row blocks a long step is cut into."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...runtime.metadata import StepMetadata
from . import sizes


def query_block_rows(meta: StepMetadata, heads: int, head_dim: int, min_ratio: int | None) -> int:
    """Rows per query block for this step: the query row ([heads, head_dim]) or the entry row a query of
    the longest sequence may score (compressed at `min_ratio`, None: no compressed layer) is the width."""
    widest = heads * head_dim
    if min_ratio and meta.num_seqs:
        widest = max(widest, int(meta.ends.max()) // min_ratio)
    return max(1, sizes.QUERY_BLOCK_ELEMENTS // widest)


def row_blocks(meta: StepMetadata, rows: int | None) -> list[tuple[int, int, StepMetadata, list[Group]]]:
    """(first row, end row, metadata, groups) of each query block of `meta`'s packed rows: the whole step
    (its own groups) when it has at most `rows` rows (None: always), else consecutive blocks of `rows`
    rows as `StepMetadata.row_block` steps. The query side of attention runs per block once every row's
    keys are in the pools; build them once per step (their index tensors are shared by every layer)."""
    n = int(meta.offsets[-1])
    step = n if rows is None else max(1, rows)
    spans = [(lo, min(lo + step, n)) for lo in range(0, n, step)] or [(0, 0)]
    metas = [meta] if len(spans) == 1 else [meta.row_block(lo, hi) for lo, hi in spans]
    return [(lo, hi, m, make_groups(m)) for (lo, hi), m in zip(spans, metas, strict=True)]


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
    # Integer forms of `qmask`, built on the host: indexing a device tensor with a boolean mask costs a
    # nonzero() and a host sync per call (several per layer); an index tensor sent once per step does not.
    packed_rows: torch.Tensor | None = None  # long [n] packed rows of the real slots, [G, Q] row-major
    real_slots: torch.Tensor | None = None  # long [n] flat [G*Q] index of the real slots; None: no padding
    host_q_pos: np.ndarray | None = None  # int64 [G, Q] `q_pos` on the host (band masks are built there)
    # `packed_rows` is exactly 0 .. N-1 for the step's N rows (one group holding every row, sequences in row
    # order: a prefill chunk of one sequence, or equal chunks; padding slots may still exist, `real_slots`):
    # per-group outputs (`real`) are then the step's rows as they are, no scatter into a step-sized buffer
    # (a 1 GiB index_put per layer in a 16k-token prefill)
    covers_step: bool = False

    @property
    def slot_rows(self) -> torch.Tensor:
        """Packed row of every query slot, padding included: long [G*Q]."""
        return self.rows.reshape(-1)

    def real(self, x: torch.Tensor) -> torch.Tensor:
        """The real query slots of `x` [G*Q, ...] (every slot, row-major), in `packed_rows` order."""
        return x if self.real_slots is None else x[self.real_slots]


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
        host_mask = slot < qlen[:, None]
        real = np.flatnonzero(host_mask.reshape(-1))
        padded = len(real) < host_mask.size
        host_q_pos = None if meta.host_positions is None else meta.host_positions[host_rows]
        groups.append(
            Group(
                seqs,
                rows,
                meta.dev(host_mask),
                meta.positions[rows],
                len(groups),
                packed_rows=meta.dev(host_rows.reshape(-1)[real]) if padded else rows.reshape(-1),
                real_slots=meta.dev(real) if padded else None,
                host_q_pos=host_q_pos,
                covers_step=_covers_step(host_rows.reshape(-1)[real], int(meta.offsets[-1])),
            )
        )
    return groups


def _covers_step(packed: np.ndarray, n_rows: int) -> bool:
    """Whether packed rows `packed` are 0 .. n_rows - 1 in order (host arrays: no device work)."""
    return packed.shape[0] == n_rows and bool((packed == np.arange(n_rows)).all())
