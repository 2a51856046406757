"""Test sequences as plain dicts, and the `StepBatch` of a step over some of them.

A test sequence is `{"id": int, "n": tokens already in its cache, "tokens": list of ids (prompt plus
what it has generated or been fed), "table": list of block ids}`. Runner tests drive the runtime with
hand-built steps (chunks, decodes, verify blocks); these two functions are the bookkeeping they share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..runner import StepBatch


def grow_tables(seqs: list[dict], query_lens: list[int], free: list[int], block_size: int) -> None:
    """Give each sequence blocks from `free` (popped from its end) until its table holds its next
    `query_lens[i]` tokens."""
    for s, q in zip(seqs, query_lens):
        while len(s["table"]) * block_size < s["n"] + q:
            s["table"].append(free.pop())


def batch_of(seqs: list[dict], query_lens: list[int], logits_lens: list[int] | None = None) -> StepBatch:
    """The step that feeds sequence i its next `query_lens[i]` tokens (from position `n`), with logits
    for `logits_lens[i]` rows of it (default: one, the last)."""
    # imported here: the model package imports `testing` (checkpoint.py), and the runner imports the
    # runtime, which imports the model: at module level this would close an import cycle
    from ..runner import StepBatch

    return StepBatch.of(
        seq_ids=np.array([s["id"] for s in seqs]),
        start_positions=np.array([s["n"] for s in seqs]),
        query_lens=np.array(query_lens),
        block_tables=[np.array(s["table"], dtype=np.int32) for s in seqs],
        input_ids=np.array([t for s, q in zip(seqs, query_lens) for t in s["tokens"][s["n"] : s["n"] + q]]),
        logits_lens=np.ones(len(seqs), dtype=np.int64) if logits_lens is None else np.array(logits_lens),
    )
