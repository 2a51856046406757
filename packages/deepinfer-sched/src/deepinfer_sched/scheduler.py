"""The Python face of the C++ scheduler: typed signatures and input normalisation only.

Every method not defined here is the C++ one (``deepinfer_sched._core``), called directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from deepinfer_sched._core import SchedulerOutput, _NativeScheduler
from deepinfer_sched.config import SchedulerConfig


class FinishedSequence(NamedTuple):
    seq_id: int
    finish_reason: str  # "stop", "length", "max_model_len", "abort", "prefilled" or "preempted"


class ScheduledSeq(NamedTuple):
    """One row of ``SchedulerOutput.scheduled_seqs``."""

    seq_id: int
    start_position: int  # tokens with KV before this step
    num_query_tokens: int
    is_prefill: bool
    num_draft_tokens: int


_INT32 = np.dtype(np.int32)


def _int32_array(values, field: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{field} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{field} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype != _INT32:
        if arr.min() < -(2**31) or arr.max() >= 2**31:
            raise ValueError(f"{field} must fit in int32")
        arr = arr.astype(np.int32)
    return arr


class Scheduler(_NativeScheduler):
    """Continuous-batching scheduler over a paged KV pool (see the package README)."""

    def __init__(self, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        super().__init__(config.to_native())
        self.config = config

    def add_request(
        self,
        prompt_token_ids: Sequence[int] | np.ndarray,
        *,
        seq_id: int | None = None,
        max_tokens: int = 16,
        min_tokens: int = 0,
        stop_token_ids: Iterable[int] = (),
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        priority: int = 0,
        arrival_time: float | None = None,
        cached_block_ids: Sequence[int] | np.ndarray | None = None,
        cache_salt: int = 0,
    ) -> int:
        """Queue a request; returns its seq id (``seq_id=None`` picks the next free one).

        ``priority``: smaller runs first; equal priorities are served in arrival order.
        ``arrival_time``: seconds on ``time.monotonic()``'s clock (now by default).
        ``cached_block_ids``: COMPLETION engines only; the blocks already holding the prompt's KV.
        ``cache_salt``: prefix-cache namespace in [0, 2**63): requests share cached blocks only when
        their salts are equal (0, the default, is shared by all).
        """
        for name, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens), ("priority", priority)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | np.integer)
                or not -(2**31) <= value < 2**31
            ):
                raise ValueError(f"{name} must be an int32 integer, got {value!r}")
        if seq_id is not None and (not isinstance(seq_id, int | np.integer) or seq_id < 0):
            raise ValueError(f"seq_id must be a non-negative integer or None, got {seq_id!r}")
        if eos_token_id is not None and eos_token_id < 0:
            raise ValueError(f"eos_token_id must be >= 0 or None, got {eos_token_id}")
        if (
            isinstance(cache_salt, bool)
            or not isinstance(cache_salt, int | np.integer)
            or not 0 <= cache_salt < 2**63
        ):
            raise ValueError(f"cache_salt must be an integer in [0, 2**63), got {cache_salt!r}")
        blocks = None if cached_block_ids is None else _int32_array(cached_block_ids, "cached_block_ids")
        return self._add_request(
            _int32_array(prompt_token_ids, "prompt_token_ids"),
            -1 if seq_id is None else int(seq_id),
            int(max_tokens),
            int(min_tokens),
            [int(t) for t in stop_token_ids],
            -1 if eos_token_id is None else int(eos_token_id),
            bool(ignore_eos),
            int(priority),
            -1.0 if arrival_time is None else float(arrival_time),
            blocks,
            int(cache_salt),
        )

    def update_from_output(
        self,
        sched_output: SchedulerOutput,
        sampled_token_ids: np.ndarray | tuple[np.ndarray, np.ndarray] | Sequence[Sequence[int] | int],
    ) -> list[FinishedSequence]:
        """Commit one step's sampled tokens; returns the sequences that finished (including those a
        scheduler finished while scheduling this step, reason "preempted": ``finish_preempted``, or a
        COMPLETION engine out of blocks).

        ``sampled_token_ids`` is, per scheduled sequence in ``sched_output`` order, either
        - a 1-D int array with exactly one token each (plain decoding; the token of a prompt chunk that
          does not end its prompt is ignored),
        - a pair ``(flat_tokens, counts)`` of int arrays, or
        - a list with one list/array of tokens each: the accepted drafts followed by the token sampled
          after them (``len = accepted + 1``); empty for a prompt chunk that does not end its prompt.
        """
        s = sampled_token_ids
        if not isinstance(s, np.ndarray | tuple | list) and hasattr(s, "__array__"):
            s = np.asarray(s)  # e.g. a CPU torch tensor: zero-copy
        if isinstance(s, np.ndarray) and s.ndim == 1:
            raw = self._update(sched_output, s, None)
        elif isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], np.ndarray):
            raw = self._update(sched_output, s[0], _int32_array(s[1], "counts"))
        else:
            rows = list(s)
            if all(isinstance(r, int | np.integer) for r in rows):
                raw = self._update(sched_output, _int32_array(rows, "sampled_token_ids"), None)
            else:
                counts = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
                flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(counts.sum()))
                raw = self._update(sched_output, _int32_array(flat, "sampled_token_ids"), counts)
        return [FinishedSequence(i, r) for i, r in raw] if raw else []

    def set_draft_tokens(self, seq_id: int, draft_token_ids: Sequence[int] | np.ndarray) -> None:
        """Drafts proposed for ``seq_id``: its next decode step verifies 1 + len(drafts) tokens."""
        super().set_draft_tokens(seq_id, _int32_array(draft_token_ids, "draft_token_ids"))

    def scheduled_seqs(self, sched_output: SchedulerOutput) -> list[ScheduledSeq]:
        """The per-sequence view of a step (convenience; the flat arrays are the fast path)."""
        return [ScheduledSeq(*row) for row in sched_output.scheduled_seqs]
