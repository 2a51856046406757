"""The recompute runner: exact logits for any scheduled step, by re-running the stateless forward.

Its "KV cache" is a paged pool of token ids addressed by the scheduler's block tables, so it is
driven exactly like a paged KV runner: each step writes the query tokens at their positions, and a
sequence's context is read back through its block table (prefix-cache hits, chunked prefill,
preemption and block reuse all work unchanged). For every sequence that needs logits it runs
`model.forward(tokens[: start + q])` — O(n^2) over a generation, but bit-for-bit independent of the
batch, which makes it the reference the paged runner is compared against.
"""

from __future__ import annotations

import numpy as np
import torch

from .step import StepBatch


class RecomputeRunner:
    def __init__(self, model, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = int(model.config.vocab_size)
        # (imported here: runtime's package imports this module, so a top-level import is a cycle)
        from ..runtime.device import model_device

        self.device = model_device(model)  # logits come back on the model's device
        # -1 marks "never written": reading it back means the scheduler's bookkeeping is wrong.
        self.token_pool = np.full((num_blocks, block_size), -1, dtype=np.int64)

    def _slots(self, block_table: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blocks = positions // self.block_size
        if len(blocks) and blocks[-1] >= len(block_table):
            raise ValueError(
                f"block table of {len(block_table)} blocks does not cover position {positions[-1]}"
            )
        return np.asarray(block_table)[blocks], positions % self.block_size

    def execute(self, batch) -> torch.Tensor:
        """float32 logits [batch.num_logits_rows, vocab]: for each sequence in order, its last
        `logits_lens[i]` query positions. `batch`: a StepBatch or a deepinfer_sched SchedulerOutput."""
        if not isinstance(batch, StepBatch):
            batch = StepBatch.from_scheduler_output(batch)
        offsets = batch.query_offsets
        # Write every sequence's query tokens first: sequences sharing cached prefix blocks then all
        # see complete contexts regardless of their order in the batch.
        for i in range(len(batch.seq_ids)):
            start, q = int(batch.start_positions[i]), int(batch.query_lens[i])
            tokens = batch.input_ids[offsets[i] : offsets[i] + q]
            if np.any(tokens < 0) or np.any(tokens >= self.vocab_size):
                raise ValueError(
                    f"sequence {int(batch.seq_ids[i])}: token ids must be in [0, {self.vocab_size})"
                )
            self.token_pool[self._slots(batch.table(i), np.arange(start, start + q))] = tokens
        rows = []
        for i in range(len(batch.seq_ids)):
            n = int(batch.logits_lens[i])
            if n == 0:
                continue
            end = int(batch.start_positions[i] + batch.query_lens[i])
            context = self.token_pool[self._slots(batch.table(i), np.arange(end))]
            if np.any(context < 0):
                raise RuntimeError(f"sequence {int(batch.seq_ids[i])}: context reads a block never written")
            out = self.model.forward(context)  # the model moves the ids to its device
            logits = out.logits if hasattr(out, "logits") else out  # V4.1 returns a V41Output
            rows.append(logits[-n:].float())
        if not rows:
            return torch.empty(0, self.vocab_size, device=self.device)
        return torch.cat(rows)
