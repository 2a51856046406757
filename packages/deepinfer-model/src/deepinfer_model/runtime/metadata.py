"""Step metadata: everything the cached forward needs about one packed batch, built once, vectorised.

From a `RunnerBatch` (flat numpy arrays of the scheduler's step) it derives the packed token positions,
the sequence of every token, the padded block-table matrix and the flat cache slot of every query
token. Per-sequence context ranges are read through `token_slots` / `entry_slots`, which are numpy
gathers (no per-token Python loop anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..runner.batch import RunnerBatch
from .device import to_device


@dataclass
class StepMetadata:
    block_size: int
    starts: np.ndarray  # int64 [B] tokens already cached before this step
    query_lens: np.ndarray  # int64 [B]
    ends: np.ndarray  # int64 [B] = starts + query_lens (the context length after this step)
    offsets: np.ndarray  # int64 [B + 1] start of each sequence's rows in the packed tokens
    tables: np.ndarray  # int64 [B, max_blocks] physical block ids, -1 padded
    input_ids: torch.Tensor  # long [N]
    positions: torch.Tensor  # long [N] absolute position of every packed token
    write_slots: torch.Tensor  # long [N] flat token slot (block * block_size + offset) of every packed token
    logits_rows: torch.Tensor  # long [R] packed rows whose logits are returned, in batch order
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the tensors live
    # host copies of `positions` / `write_slots` / `logits_rows` (numpy), for host-side planning (YOCO)
    # without reading back from the device
    host_positions: np.ndarray | None = None
    host_write_slots: np.ndarray | None = None
    host_logits_rows: np.ndarray | None = None
    # True when `build` checked every input id against the vocabulary on the host: the embedding then
    # skips its device-side range check (two device->host reads per step)
    ids_checked: bool = False
    # device copies of per-step index arrays (group gathers), built once and reused by every layer
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        batch: RunnerBatch,
        block_size: int,
        num_blocks: int,
        device: torch.device | None = None,
        vocab_size: int | None = None,
    ) -> StepMetadata:
        """Numpy on the host; the four tensors are sent to `device` (default CPU) once each.

        With `vocab_size`, every input id is checked to lie in [0, vocab_size) here, on the host copy,
        once per step (ValueError naming the sequence, the id and the range), and `ids_checked` is set.
        """
        device = torch.device("cpu") if device is None else torch.device(device)
        starts = np.asarray(batch.start_positions, dtype=np.int64)
        qlens = np.asarray(batch.query_lens, dtype=np.int64)
        if np.any(starts < 0) or np.any(qlens < 0):
            raise ValueError("start_positions and query_lens must be >= 0 for every sequence")
        input_ids = np.asarray(batch.input_ids, dtype=np.int64)
        if vocab_size is not None:
            _check_ids(input_ids, qlens, np.asarray(batch.seq_ids), int(vocab_size))
        ends = starts + qlens
        offsets = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens, out=offsets[1:])
        n = int(offsets[-1])
        width = max((len(t) for t in batch.block_tables), default=0)
        tables = np.full((len(qlens), max(width, 1)), -1, dtype=np.int64)
        for i, t in enumerate(batch.block_tables):  # per sequence, not per token
            tables[i, : len(t)] = t
        need = -(-ends // block_size)
        have = (tables >= 0).sum(axis=1)
        if np.any(need > have):
            i = int(np.argmax(need > have))
            raise ValueError(
                f"sequence {int(batch.seq_ids[i])}: block table of {int(have[i])} blocks does not cover "
                f"position {int(ends[i]) - 1} (block_size {block_size})"
            )
        if np.any(tables >= num_blocks):
            raise ValueError(f"block ids must be in [0, {num_blocks}), got {int(tables.max())}")
        seq_of = np.repeat(np.arange(len(qlens)), qlens)
        positions = np.arange(n, dtype=np.int64) - offsets[:-1][seq_of] + starts[seq_of]
        slots = tables[seq_of, positions // block_size] * block_size + positions % block_size
        llens = np.asarray(batch.logits_lens, dtype=np.int64)
        # the last llens[i] packed rows of sequence i: offsets[i+1] - llens[i] + k, k < llens[i]
        k = np.arange(int(llens.sum())) - np.repeat(np.cumsum(llens) - llens, llens)
        logits_rows = np.repeat(offsets[1:] - llens, llens) + k
        return cls(
            block_size=block_size,
            starts=starts,
            query_lens=qlens,
            ends=ends,
            offsets=offsets,
            tables=tables,
            input_ids=to_device(input_ids, device),
            positions=to_device(positions, device),
            write_slots=to_device(slots, device),
            logits_rows=to_device(logits_rows, device),
            device=device,
            host_positions=positions,
            host_write_slots=slots,
            host_logits_rows=logits_rows,
            ids_checked=vocab_size is not None,
        )

    def dev(self, array) -> torch.Tensor:
        """A host array of this step on the step's device (one copy per call; see `cached`)."""
        return to_device(array, self.device)

    def cached(self, key, make):
        """`make()` once per step for `key` (index tensors shared by every layer of the step)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    def rows(self, i: int) -> slice:
        """Packed rows of sequence `i`."""
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def token_slots_of(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Flat token slots of positions `pos` of sequences `seq` (broadcast together)."""
        return self.tables[seq, pos // self.block_size] * self.block_size + pos % self.block_size

    def entry_slots_of(self, seq: np.ndarray, j: np.ndarray, ratio: int) -> np.ndarray:
        """Flat entry-pool slots of compressed entries `j` of sequences `seq` (broadcast together).

        Entry j (tokens j*r .. j*r+r-1) lives in the block holding token j*r, so freeing, sharing and
        reusing blocks moves compressed entries together with the tokens they summarise.
        """
        first = j * ratio
        per_block = entries_per_block(self.block_size, ratio)
        return self.tables[seq, first // self.block_size] * per_block + (first % self.block_size) // ratio

    def token_slots(self, i: int, lo: int, hi: int) -> torch.Tensor:
        """Flat token slots of sequence `i`'s positions lo .. hi-1."""
        pos = np.arange(lo, hi, dtype=np.int64)
        return self.dev(self.tables[i, pos // self.block_size] * self.block_size + pos % self.block_size)

    def entry_slots(self, i: int, lo: int, hi: int, ratio: int) -> torch.Tensor:
        """Flat slots of sequence `i`'s compressed entries lo .. hi-1 in a pool of ratio `ratio`."""
        return self.dev(self.entry_slots_of(i, np.arange(lo, hi, dtype=np.int64), ratio))


def _check_ids(ids: np.ndarray, qlens: np.ndarray, seq_ids: np.ndarray, vocab_size: int) -> None:
    """ValueError for the first input id outside [0, vocab_size), naming its sequence and packed row."""
    if len(ids) != int(qlens.sum()):
        raise ValueError(f"input_ids has {len(ids)} tokens, query_lens sum to {int(qlens.sum())}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(bad):
        row = int(bad[0])
        i = int(np.searchsorted(np.cumsum(qlens), row, side="right"))
        raise ValueError(
            f"sequence {int(seq_ids[i])}: input_ids[{row}] = {int(ids[row])} is outside the vocabulary; "
            f"token ids must be in [0, vocab_size={vocab_size})"
        )


def entries_per_block(block_size: int, ratio: int) -> int:
    if block_size % ratio and ratio % block_size:
        raise ValueError(
            f"block_size {block_size} and compress ratio {ratio} must divide one another "
            "(a compressed entry must map to exactly one block)"
        )
    return max(1, block_size // ratio)
