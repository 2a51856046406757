"""Step metadata: everything the cached forward needs about one packed batch, built once, vectorised.

From a `StepBatch` (the scheduler's own arrays of one step: packed positions, cache slots, query starts,
the padded block-table matrix) it takes those arrays as they are and puts the per-token ones on the
device. Per-sequence context ranges are read through `token_slots` / `entry_slots`, which are numpy
gathers (no per-token Python loop anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from ..runner.step import StepBatch
from .device import to_device
from .step_buffers import StepBuffers
from .step_view import entries_per_block


@dataclass
class StepMetadata:
    """The eager `StepView`: host arrays of the step (ragged per sequence) beside its device tensors;
    index tensors are planned on the host per step (`cached`) and sent once."""

    graph_safe: ClassVar[bool] = False
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
    # True when some of `input_ids` were filled on the device (`StepBatch.device_input_ids`): the host
    # array the step was built from holds placeholders there, so consumers read `input_ids`
    device_fed: bool = False
    # device copies of per-step index arrays (group gathers), built once and reused by every layer
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        step: StepBatch,
        block_size: int,
        num_blocks: int,
        device: torch.device | None = None,
        vocab_size: int | None = None,
        buffers: StepBuffers | None = None,
    ) -> StepMetadata:
        """The step's own arrays (positions, slots, query starts, block tables: nothing recomputed), its
        per-token tensors sent to `device` (default CPU) through `buffers` (the runner's persistent ones:
        one copy) or one copy each without.

        With `vocab_size`, every input id is checked to lie in [0, vocab_size) here, on the host copy,
        once per step (ValueError naming the sequence, the id and the range), and `ids_checked` is set.
        """
        device = torch.device("cpu") if device is None else torch.device(device)
        input_ids = step.input_ids
        fed = step.device_input_ids  # (rows, device ids): sampled on the device
        if vocab_size is not None:
            checked = input_ids
            if fed is not None and len(fed[0]):  # (sampler outputs: in the vocabulary by construction)
                checked = input_ids.copy()
                checked[np.asarray(fed[0])] = 0
            _check_ids(checked, step.query_lens, step.seq_ids, int(vocab_size))
        step.check_tables(block_size, num_blocks)
        step._compute_slots(block_size)
        slots = step.slot_mapping
        logits_rows = step.logits_rows()
        if buffers is not None:
            ids, positions, write_slots, rows = buffers.load(input_ids, step.positions, slots, logits_rows)
        else:
            ids, positions = to_device(input_ids, device), to_device(step.positions, device)
            write_slots, rows = to_device(slots, device), to_device(logits_rows, device)
            if fed is not None and len(fed[0]) and device.type == "cpu":
                ids = ids.clone()  # (a view of the caller's array on the CPU)
        if fed is not None and len(fed[0]):
            ids[to_device(np.asarray(fed[0], dtype=np.int64), device)] = fed[1].to(device)
        return cls(
            block_size=block_size,
            starts=step.start_positions,
            query_lens=step.query_lens,
            ends=step.seq_lens,
            offsets=step.query_start_loc,
            tables=step.block_tables,
            input_ids=ids,
            positions=positions,
            write_slots=write_slots,
            logits_rows=rows,
            device=device,
            host_positions=step.positions,
            host_write_slots=slots,
            host_logits_rows=logits_rows,
            ids_checked=vocab_size is not None,
            device_fed=fed is not None and len(fed[0]) > 0,
        )

    def row_block(self, lo: int, hi: int) -> StepMetadata:
        """The queries of packed rows lo .. hi-1 as a step of their own whose keys were written before it:
        each sequence's rows in the range, starting where they start, ending at the block's last query
        (`ends` = last position + 1), the rest of each sequence's step counted as not there yet. Exactly
        the metadata of a prefill chunk that ends at row `hi`, so the query side of attention can run per
        row block of a long step once the whole step's keys are in the pools. No logits rows."""
        first, last = self.offsets[:-1], self.offsets[1:]
        shift = np.clip(lo - first, 0, self.query_lens)
        qlens = np.clip(np.minimum(last, hi) - np.maximum(first, lo), 0, None)
        offsets = np.zeros_like(self.offsets)
        np.cumsum(qlens, out=offsets[1:])
        starts = self.starts + shift
        rows = slice(lo, hi)
        host = lambda a: None if a is None else a[rows]  # noqa: E731
        return StepMetadata(
            block_size=self.block_size,
            starts=starts,
            query_lens=qlens,
            ends=starts + qlens,
            offsets=offsets,
            tables=self.tables,
            input_ids=self.input_ids[rows],
            positions=self.positions[rows],
            write_slots=self.write_slots[rows],
            logits_rows=self.logits_rows[:0],
            device=self.device,
            host_positions=host(self.host_positions),
            host_write_slots=host(self.host_write_slots),
            host_logits_rows=None if self.host_logits_rows is None else self.host_logits_rows[:0],
            ids_checked=self.ids_checked,
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
