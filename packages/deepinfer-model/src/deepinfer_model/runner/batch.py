"""`RunnerBatch`: what a model runner needs from one scheduled step, as flat numpy arrays.

It is the runner-facing view of the scheduler's output (`from_scheduler_output` converts), so the
recompute runner here and the paged runner later consume exactly the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class RunnerBatch:
    seq_ids: np.ndarray  # int64 [B]
    start_positions: np.ndarray  # int64 [B]: tokens of the sequence already computed before this step
    query_lens: np.ndarray  # int64 [B]: tokens this step computes, at positions start .. start+q-1
    block_tables: list[np.ndarray]  # per sequence, int32 block ids covering positions 0 .. start+q-1
    input_ids: np.ndarray  # int64 [sum(query_lens)]: the query tokens, sequence after sequence
    logits_lens: np.ndarray  # int64 [B]: trailing query positions that need logits (0: none, 1: last)
    # (packed rows int64 [F], ids long tensor [F] on the model's device): input ids that are known only on
    # the device (the asynchronous loop's tokens sampled by the step before, not yet read back); their
    # entries of `input_ids` are placeholders. Runners that take them have `takes_device_input_ids`.
    device_input_ids: tuple[np.ndarray, Any] | None = None
    # int64 [B]: each sequence's ORIGINAL prompt length (the scheduler's `prompt_lens`: unchanged by
    # preemption and recompute), read by a model family's per-step extras (YOCO truncation); None when
    # the step was built by hand without them
    prompt_lens: np.ndarray | None = None

    def __post_init__(self) -> None:
        b = len(self.seq_ids)
        for name in ("start_positions", "query_lens", "logits_lens"):
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
        if int(self.query_lens.sum()) != len(self.input_ids):
            raise ValueError(
                f"input_ids must hold sum(query_lens)={int(self.query_lens.sum())} tokens, got {len(self.input_ids)}"
            )
        if np.any(self.logits_lens > self.query_lens) or np.any(self.logits_lens < 0):
            raise ValueError("logits_lens must be in [0, query_lens] for every sequence")
        if self.device_input_ids is not None:
            rows, ids = self.device_input_ids
            n = len(self.input_ids)
            if len(rows) != len(ids) or (len(rows) and (int(np.min(rows)) < 0 or int(np.max(rows)) >= n)):
                raise ValueError(
                    f"device_input_ids: {len(rows)} rows in [0, {n}) with one id each expected, got "
                    f"{len(ids)} ids for rows {np.asarray(rows).tolist()[:8]}"
                )

    @classmethod
    def from_scheduler_output(cls, out, allow_unknown: bool = False) -> RunnerBatch:
        """From a `deepinfer_sched.SchedulerOutput`. One row of logits per sequence that emits a token
        (non-final prefill chunks emit none). Input ids must all be known (a synchronous step, or an
        asynchronous one after `Scheduler.reconcile`) unless `allow_unknown`: then the caller fills
        the -1 entries (from the previous step's tokens, via `prev_rows`) before `execute`."""
        if not allow_unknown and getattr(out, "has_unknown_input_ids", False):
            raise ValueError(
                "the step still has unknown input ids: reconcile it with the previous step first"
            )
        tables = np.asarray(out.block_tables)
        return cls(
            seq_ids=np.asarray(out.seq_ids, dtype=np.int64),
            start_positions=np.asarray(out.start_positions, dtype=np.int64),
            query_lens=np.asarray(out.query_lens, dtype=np.int64),
            block_tables=[row[row >= 0] for row in tables],  # rows are padded with -1
            input_ids=np.asarray(out.input_ids, dtype=np.int64),
            logits_lens=np.asarray(out.emits_tokens, dtype=bool).astype(np.int64),
            prompt_lens=np.asarray(out.prompt_lens, dtype=np.int64),
        )

    @classmethod
    def lockstep(cls, block_tables: list[np.ndarray], start: int, input_ids) -> RunnerBatch:
        """A step in which every sequence i (row i of `input_ids` [B, q]) computes q tokens from position
        `start`, with one logits row: the lock-step batches of benchmarks and tools."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(len(block_tables), -1)
        b, q = ids.shape
        return cls(
            seq_ids=np.arange(b, dtype=np.int64),
            start_positions=np.full(b, start, dtype=np.int64),
            query_lens=np.full(b, q, dtype=np.int64),
            block_tables=list(block_tables),
            input_ids=np.ascontiguousarray(ids).reshape(-1),
            logits_lens=np.ones(b, dtype=np.int64),
        )

    @property
    def num_logits_rows(self) -> int:
        return int(self.logits_lens.sum())

    @property
    def query_offsets(self) -> np.ndarray:
        """Start of each sequence's query tokens in `input_ids`."""
        return np.concatenate(([0], np.cumsum(self.query_lens)[:-1])).astype(np.int64)
