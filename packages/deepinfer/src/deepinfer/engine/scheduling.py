"""The engine's only contact with `deepinfer_sched`: building the scheduler and reading its output.

Kept in one file so the rest of the engine speaks in engine terms (sequences, batches, tokens).
"""

from __future__ import annotations

import numpy as np
from deepinfer_model import StepBatch
from deepinfer_sched import Scheduler, SchedulerConfig, SequenceStatus

from ..sampling_params import SamplingParams


def make_scheduler(
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    chunked_prefill: bool,
    num_speculative_tokens: int = 0,
    enable_prefix_caching: bool = True,
    finish_preempted: bool = False,
    report_evictions: bool = False,
    engine_type: str = "normal",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked_prefill,
            num_speculative_tokens=num_speculative_tokens,
            enable_prefix_caching=enable_prefix_caching,
            finish_preempted=finish_preempted,
            report_evictions=report_evictions,
            engine_type=engine_type,
        )
    )


def add_sequence(
    sched: Scheduler,
    seq_id: int,
    prompt: list[int],
    params: SamplingParams,
    eos_token_id: int | None,
    max_tokens: int,
    cache_salt: int = 0,
    cached_block_ids: list[int] | None = None,
) -> None:
    sched.add_request(
        np.asarray(prompt, dtype=np.int32),
        seq_id=seq_id,
        max_tokens=max_tokens,
        min_tokens=min(params.min_tokens, max_tokens),
        stop_token_ids=list(params.stop_token_ids),
        eos_token_id=eos_token_id,
        ignore_eos=params.ignore_eos,
        cache_salt=cache_salt,
        cached_block_ids=cached_block_ids,
    )


def schedule(sched: Scheduler):
    return sched.schedule()


def is_empty(out) -> bool:
    return out is None or out.is_empty


def reconcile(sched: Scheduler, out):
    return sched.reconcile(out) if out.has_unknown_input_ids else out


def seq_ids(out) -> np.ndarray:
    return np.asarray(out.seq_ids)


def emits_tokens(out) -> np.ndarray:
    return np.asarray(out.emits_tokens, dtype=bool)


def to_runner_batch(out, allow_unknown: bool = False) -> StepBatch:
    return StepBatch.from_scheduler_output(out, allow_unknown=allow_unknown)


def num_draft_tokens(out) -> np.ndarray:
    """Drafts fed (to verify) per scheduled sequence: its query is [last token, d1..dk]."""
    return np.asarray(out.num_draft_tokens, dtype=np.int64)


def is_prefill(out) -> np.ndarray:
    return np.asarray(out.is_prefill, dtype=bool)


def to_verify_batch(out) -> StepBatch:
    """A runner batch whose decode rows ask logits for every query token (1 + drafts each)."""
    return StepBatch.from_scheduler_output(out, every_row=True)


def set_draft_tokens(sched: Scheduler, seq_id: int, drafts: list[int]) -> None:
    sched.set_draft_tokens(seq_id, np.asarray(drafts, dtype=np.int32))


def has_draft_tokens(sched: Scheduler) -> bool:
    """Whether some running sequence has drafts set for its next step (only running ones can: a
    preemption or a finish clears them)."""
    return any(len(sched.draft_token_ids(seq_id)) for seq_id in sched.running_ids())


def update_from_lists(sched: Scheduler, out, emitted: list[list[int]]) -> dict[int, str]:
    """emitted: per scheduled sequence, its accepted drafts then the token sampled after them
    ([] where it emits none). Returns {seq_id: finish reason}."""
    finished = sched.update_from_output(out, emitted)
    return {int(f.seq_id): str(f.finish_reason) for f in finished}


def prev_rows(out) -> np.ndarray:
    """Per sequence, its row in the unprocessed previous step (-1: none)."""
    return np.asarray(out.prev_rows, dtype=np.int64).copy()


def update_from_output(sched: Scheduler, out, tokens: np.ndarray) -> dict[int, str]:
    """tokens: one per scheduled sequence, -1 where it emits none. Returns {seq_id: finish reason}."""
    counts = (tokens >= 0).astype(np.int32)
    finished = sched.update_from_output(out, (tokens[tokens >= 0].astype(np.int32), counts))
    return {int(f.seq_id): str(f.finish_reason) for f in finished}


def preempted(out) -> list[int]:
    """Sequences this schedule preempted (their KV is dropped; they recompute later, or have finished
    with reason "preempted" when the scheduler finishes preempted sequences)."""
    return [] if out is None else np.asarray(out.preempted_seq_ids).tolist()


def num_output_tokens(sched: Scheduler, seq_id: int) -> int:
    """Output tokens the scheduler has committed for a sequence."""
    return len(sched.output_token_ids(seq_id))


def retire(sched: Scheduler, out) -> dict[int, str]:
    """Close a step that will not run (empty): the scheduler counts every scheduled step until updated.
    Returns {seq_id: finish reason} of the sequences its schedule finished (preempted ones)."""
    finished = sched.update_from_output(out, (np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32)))
    return {int(f.seq_id): str(f.finish_reason) for f in finished}


def close_failed(sched: Scheduler, out) -> None:
    """Close a step whose sequences were all aborted (a failed step): none of them receives a token."""
    sched.update_from_output(out, (np.empty(0, dtype=np.int32), np.zeros(len(seq_ids(out)), dtype=np.int32)))


def num_computed_tokens(sched: Scheduler, seq_id: int) -> int:
    """Tokens of the sequence whose KV the scheduler counts as computed (cached prefix included)."""
    return sched.num_computed_tokens(seq_id)


def is_unstarted(sched: Scheduler, seq_id: int) -> bool:
    """Waiting, never scheduled: no KV, no tokens, nothing in flight, so it may start anywhere else."""
    return (
        sched.status(seq_id) == SequenceStatus.WAITING
        and sched.num_computed_tokens(seq_id) == 0
        and sched.num_preemptions(seq_id) == 0
        and len(sched.output_token_ids(seq_id)) == 0
    )


def block_table(sched: Scheduler, seq_id: int) -> list[int]:
    return list(sched.block_table(seq_id))


def requeue(sched: Scheduler, out, seq_id: int) -> bool:
    """Send a running sequence of `out` (the latest unprocessed step) back to waiting to recompute;
    False where the scheduler would finish a preempted sequence instead."""
    return bool(sched.requeue(seq_id, out))


def abort(sched: Scheduler, seq_id: int) -> None:
    sched.abort(seq_id)


def release(sched: Scheduler, seq_id: int) -> None:
    sched.release(seq_id)


def stats(sched: Scheduler) -> dict:
    return dict(sched.stats())
