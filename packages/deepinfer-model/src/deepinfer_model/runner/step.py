"""`StepBatch`: one scheduled step as the scheduler's own flat arrays, the one thing every runner executes.

A step from the scheduler (`from_scheduler_output`) keeps the arrays the scheduler produced: query starts,
token positions, cache slots, the dense block-table matrix. A step built by hand (`of`, `lockstep`: tools,
tests, benchmarks) computes the very same arrays with the scheduler's rules, so both kinds take one
path through the runner and nothing downstream recomputes positions, slots or offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(eq=False)
class StepBatch:
    seq_ids: np.ndarray  # int64 [B]
    query_start_loc: np.ndarray  # int64 [B + 1]: start of each sequence's rows in the packed tokens
    start_positions: np.ndarray  # int64 [B]: tokens of the sequence already cached before this step
    query_lens: np.ndarray  # int64 [B]: tokens this step computes, at positions start .. start+q-1
    seq_lens: np.ndarray  # int64 [B] = start + q: the context length after this step
    positions: np.ndarray  # int64 [T]: absolute position of every packed token
    block_tables: np.ndarray  # int64 [B, W >= 1]: physical block ids covering 0 .. seq_len-1, -1 padded
    input_ids: np.ndarray  # int64 [T]: the query tokens, sequence after sequence (writable)
    logits_lens: np.ndarray  # int64 [B]: trailing query rows that need logits (0: none, 1: last)
    # int64 [T]: flat cache slot (block * block_size + offset) of every packed token; None for a step
    # built by hand without a block size (`slots` fills it with the scheduler's rule)
    slot_mapping: np.ndarray | None = None
    # int64 [B]: each sequence's ORIGINAL prompt length (the scheduler's: unchanged by preemption and
    # recompute), read by a model family's per-step extras (YOCO truncation); None for hand-built steps
    prompt_lens: np.ndarray | None = None
    # (packed rows int64 [F], ids long tensor [F] on the model's device): input ids known only on the
    # device (the asynchronous loop's tokens sampled by the step before, not yet read back); their entries
    # of `input_ids` are placeholders. Runners that take them have `takes_device_input_ids`.
    device_input_ids: tuple[np.ndarray, Any] | None = None
    # per sequence, the input embeddings [n_i, H] of the image positions among its query rows, in position
    # order (n_i may be 0: rows of an image block without IMAGE ids); None for a sequence without image
    # sentinels this step, and the whole list None when no sequence of the step has any.
    # The model puts them at the rows whose ids are the image sentinel (`models/deepseek_v41/vision`).
    image_features: list | None = None

    def __post_init__(self) -> None:
        b = len(self.seq_ids)
        for name in ("start_positions", "query_lens", "seq_lens", "logits_lens"):
            if len(getattr(self, name)) != b:
                raise ValueError(
                    f"{name} must have one entry per sequence ({b}), got {len(getattr(self, name))}"
                )
        if self.prompt_lens is not None and len(self.prompt_lens) != b:
            raise ValueError(
                f"prompt_lens must have one entry per sequence ({b}), got {len(self.prompt_lens)}"
            )
        if len(self.block_tables) != b:
            raise ValueError(
                f"block_tables must have one entry per sequence ({b}), got {len(self.block_tables)}"
            )
        n = int(self.query_start_loc[-1])
        if len(self.input_ids) != n or len(self.positions) != n:
            raise ValueError(f"input_ids must hold sum(query_lens)={n} tokens, got {len(self.input_ids)}")
        if np.any(self.logits_lens > self.query_lens) or np.any(self.logits_lens < 0):
            raise ValueError("logits_lens must be in [0, query_lens] for every sequence")
        if self.image_features is not None and len(self.image_features) != b:
            raise ValueError(
                f"image_features must have one entry per sequence ({b}), got {len(self.image_features)}"
            )
        if self.device_input_ids is not None:
            rows, ids = self.device_input_ids
            if len(rows) != len(ids) or (len(rows) and (int(np.min(rows)) < 0 or int(np.max(rows)) >= n)):
                raise ValueError(
                    f"device_input_ids: {len(rows)} rows in [0, {n}) with one id each expected, got "
                    f"{len(ids)} ids for rows {np.asarray(rows).tolist()[:8]}"
                )

    # -- constructors -----------------------------------------------------------------------------------
    @classmethod
    def from_scheduler_output(cls, out, allow_unknown: bool = False, every_row: bool = False) -> StepBatch:
        """From a `deepinfer_sched.SchedulerOutput`, its arrays as they are. Logits rows: one per sequence
        that emits a token (non-final prefill chunks emit none), or with `every_row` the scheduler's own
        `logits_lens` (every row of a decode / verification: 1 + drafts). Input ids must all be known (a
        synchronous step, or an asynchronous one after `Scheduler.reconcile`) unless `allow_unknown`: the
        caller then fills the -1 entries (from the previous step's tokens, via `prev_rows`) before running it."""
        if not allow_unknown and getattr(out, "has_unknown_input_ids", False):
            raise ValueError(
                "the step still has unknown input ids: reconcile it with the previous step first"
            )
        lens = out.logits_lens if every_row else out.emits_tokens
        tables = np.asarray(out.block_tables, dtype=np.int64)
        if tables.shape[1] == 0:
            tables = np.full((tables.shape[0], 1), -1, dtype=np.int64)
        return cls(
            seq_ids=np.asarray(out.seq_ids, dtype=np.int64),
            query_start_loc=np.asarray(out.query_start_loc, dtype=np.int64),
            start_positions=np.asarray(out.start_positions, dtype=np.int64),
            query_lens=np.asarray(out.query_lens, dtype=np.int64),
            seq_lens=np.asarray(out.seq_lens, dtype=np.int64),
            positions=np.asarray(out.positions, dtype=np.int64),
            block_tables=tables,
            input_ids=np.array(out.input_ids, dtype=np.int64),  # a copy: the caller fills unknown ids
            logits_lens=np.asarray(lens, dtype=np.int64),
            slot_mapping=np.asarray(out.slot_mapping, dtype=np.int64),
            prompt_lens=np.asarray(out.prompt_lens, dtype=np.int64),
        )

    @classmethod
    def of(
        cls,
        seq_ids,
        start_positions,
        query_lens,
        block_tables: list,
        input_ids,
        logits_lens,
        prompt_lens=None,
        block_size: int | None = None,
    ) -> StepBatch:
        """A hand-built step: per sequence its first position, query length and block table (a list of
        1-D arrays); the packed arrays follow with the scheduler's rules (slots too, given `block_size`)."""
        starts = np.asarray(start_positions, dtype=np.int64).reshape(-1)
        qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        if np.any(starts < 0) or np.any(qlens < 0):
            raise ValueError("start_positions and query_lens must be >= 0 for every sequence")
        if len(block_tables) != len(qlens):
            raise ValueError(
                f"block_tables must have one entry per sequence ({len(qlens)}), got {len(block_tables)}"
            )
        qsl = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        seq_of = np.repeat(np.arange(len(qlens)), qlens)
        width = max((len(t) for t in block_tables), default=0)
        tables = np.full((len(qlens), max(width, 1)), -1, dtype=np.int64)
        for i, t in enumerate(block_tables):  # per sequence, not per token
            tables[i, : len(t)] = np.asarray(t).reshape(-1)
        step = cls(
            seq_ids=np.asarray(seq_ids, dtype=np.int64).reshape(-1),
            query_start_loc=qsl,
            start_positions=starts,
            query_lens=qlens,
            seq_lens=starts + qlens,
            positions=np.arange(int(qsl[-1]), dtype=np.int64) - qsl[:-1][seq_of] + starts[seq_of],
            block_tables=tables,
            input_ids=np.array(input_ids, dtype=np.int64).reshape(-1),
            logits_lens=np.asarray(logits_lens, dtype=np.int64).reshape(-1),
            prompt_lens=None if prompt_lens is None else np.asarray(prompt_lens, dtype=np.int64).reshape(-1),
        )
        if block_size is not None:
            step.slots(block_size)
        return step

    @classmethod
    def lockstep(cls, block_tables: list, start: int, input_ids, block_size: int | None = None) -> StepBatch:
        """A step in which every sequence i (row i of `input_ids` [B, q]) computes q tokens from position
        `start`, with one logits row: the lock-step batches of benchmarks and tools."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(len(block_tables), -1)
        b, q = ids.shape
        return cls.of(
            np.arange(b),
            np.full(b, start),
            np.full(b, q),
            list(block_tables),
            ids.reshape(-1),
            np.ones(b, dtype=np.int64),
            block_size=block_size,
        )

    def one(self, i: int) -> StepBatch:
        """Sequence `i` alone, as a step of its own (its rows, table and logits rows)."""
        lo, hi = int(self.query_start_loc[i]), int(self.query_start_loc[i + 1])
        s = slice(i, i + 1)
        return StepBatch(
            seq_ids=self.seq_ids[s],
            query_start_loc=self.query_start_loc[i : i + 2] - lo,
            start_positions=self.start_positions[s],
            query_lens=self.query_lens[s],
            seq_lens=self.seq_lens[s],
            positions=self.positions[lo:hi],
            block_tables=self.block_tables[s],
            input_ids=self.input_ids[lo:hi],
            logits_lens=self.logits_lens[s],
            slot_mapping=None if self.slot_mapping is None else self.slot_mapping[lo:hi],
            prompt_lens=None if self.prompt_lens is None else self.prompt_lens[s],
            image_features=None if self.image_features is None else self.image_features[s],
        )

    def step_image_features(self):
        """The step's image embeddings [n, H] in packed row order (n may be 0), or None when no sequence
        of the step carries image sentinels."""
        if self.image_features is None:
            return None
        parts = [f for f in self.image_features if f is not None]
        if not parts:
            return None
        import torch

        return torch.cat(parts)

    # -- derived --------------------------------------------------------------------------------------
    def check_tables(self, block_size: int, num_blocks: int) -> None:
        """ValueError when a sequence's table does not cover its context or names a block outside the pool."""
        need = -(-self.seq_lens // block_size)
        have = (self.block_tables >= 0).sum(axis=1)
        if np.any(need > have):
            i = int(np.argmax(need > have))
            raise ValueError(
                f"sequence {int(self.seq_ids[i])}: block table of {int(have[i])} blocks does not cover "
                f"position {int(self.seq_lens[i]) - 1} (block_size {block_size})"
            )
        if np.any(self.block_tables >= num_blocks):
            raise ValueError(f"block ids must be in [0, {num_blocks}), got {int(self.block_tables.max())}")

    def slots(self, block_size: int) -> np.ndarray:
        """The flat cache slot of every packed token: the scheduler's `slot_mapping`, or for a hand-built
        step the same rule (block of the position in the sequence's table, times the block size, plus the
        offset), computed once."""
        if self.slot_mapping is None:
            self.check_tables(block_size, np.iinfo(np.int64).max)
            self._compute_slots(block_size)
        return self.slot_mapping

    def _compute_slots(self, block_size: int) -> None:
        """`slot_mapping` of a hand-built step whose tables are checked (`check_tables`)."""
        if self.slot_mapping is None:
            seq_of = np.repeat(np.arange(len(self.query_lens)), self.query_lens)
            pos = self.positions
            self.slot_mapping = self.block_tables[seq_of, pos // block_size] * block_size + pos % block_size

    def table(self, i: int) -> np.ndarray:
        """Sequence `i`'s block ids (its row of `block_tables` without the padding)."""
        row = self.block_tables[i]
        return row[row >= 0]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_logits_rows(self) -> int:
        return int(self.logits_lens.sum())

    @property
    def query_offsets(self) -> np.ndarray:
        """Start of each sequence's query tokens in `input_ids`."""
        return self.query_start_loc[:-1]

    def logits_rows(self) -> np.ndarray:
        """Packed rows whose logits the step returns, in batch order: the last `logits_lens[i]` rows of
        each sequence i."""
        llens = self.logits_lens
        k = np.arange(int(llens.sum())) - np.repeat(np.cumsum(llens) - llens, llens)
        return np.repeat(self.query_start_loc[1:] - llens, llens) + k
