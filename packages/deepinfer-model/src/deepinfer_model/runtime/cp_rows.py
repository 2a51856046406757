"""Context-parallel rows of one packed paged step (engine spec §7.2): the balanced mirror split per sequence.

Each sequence's rows of the step (a prefill chunk, a decode token, a verify block) are cut into `2·cp`
pieces of `ceil(q / (2·cp))` rows; CP rank `r` computes the per-token work (mHC, Engram, MoE, attention
queries) of pieces `r` and `2·cp−1−r`. Keys are projected from the local rows and all-gathered in step
order, so every CP rank writes the whole step into its own paged pools: decode, which every CP rank runs
whole and alike, finds every key it needs on every rank. All math is per row, so the step's logits are
bitwise those of the unsplit step.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from deepinfer_parallel import mirror_split_plan, reverse_index

from .metadata import StepMetadata


class PagedMirrorRows:
    """This CP rank's rows of the step `meta` (`rows`, increasing), their query-side metadata `qmeta`
    (each non-empty piece a sequence of its own over its sequence's block table, the step's keys written
    before it, as `StepMetadata.row_block` does for a row range), and `gather` (collective over `group`:
    local rows -> every row of the step, in step order)."""

    def __init__(self, meta: StepMetadata, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        qlens = [int(q) for q in meta.query_lens]
        plan = mirror_split_plan(qlens, self.size, self.rank)
        index = plan.index.numpy()
        self.padded_len = len(index)  # every rank holds as many (padded) rows: a uniform all-gather
        self._valid = torch.as_tensor(index >= 0)
        rows = index[index >= 0]
        self.rows = meta.dev(rows)
        self._reverse = reverse_index(qlens, self.size).to(meta.device)
        self.qmeta = _pieces(meta, rows)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.rows]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        padded = local.new_zeros((self.padded_len, *local.shape[1:]))
        padded[self._valid.to(local.device)] = local
        shards = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(shards, padded.contiguous(), group=self.group)
        return torch.cat(shards)[self._reverse]


def _pieces(meta: StepMetadata, rows: np.ndarray) -> StepMetadata:
    """The queries of packed rows `rows` (increasing) as a step of their own: each maximal run of
    consecutive rows of one sequence is a sequence over that sequence's block table."""
    seq_of = np.repeat(np.arange(meta.num_seqs), meta.query_lens)[rows]
    breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(seq_of) != 0)) + 1
    firsts = np.concatenate(([0], breaks)) if len(rows) else np.zeros(0, dtype=np.int64)
    lens = np.diff(np.concatenate((firsts, [len(rows)]))).astype(np.int64)
    seqs = seq_of[firsts]
    starts = meta.starts[seqs] + (rows[firsts] - meta.offsets[seqs])
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    r = meta.dev(rows)
    host = lambda a: None if a is None else a[rows]  # noqa: E731
    return StepMetadata(
        block_size=meta.block_size,
        starts=starts,
        query_lens=lens,
        ends=starts + lens,
        offsets=offsets,
        tables=meta.tables[seqs],
        input_ids=meta.input_ids[r],
        positions=meta.positions[r],
        write_slots=meta.write_slots[r],
        logits_rows=meta.logits_rows[:0],
        device=meta.device,
        host_positions=host(meta.host_positions),
        host_write_slots=host(meta.host_write_slots),
        host_logits_rows=None if meta.host_logits_rows is None else meta.host_logits_rows[:0],
        ids_checked=meta.ids_checked,
    )
