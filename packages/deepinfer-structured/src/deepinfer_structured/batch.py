"""Masks for a whole step: fill every structured row of a mixed batch together, apply in place.

The engine calls `BatchMasker.fill` once per step with the structured sequences only (free rows are
not touched), then `apply_bitmask_inplace(logits, masks)` right before sampling / verification.
Rows that restrict nothing (trigger not seen yet) are left out of `rows`, so applying skips them.

With drafts, a sequence owns rows first_row .. first_row + len(drafts): the mask for its next token
and for the token after each draft prefix; a draft the grammar rejects gets zero target probability
and verification rejects it. Grammar-phase rows of all sequences are filled by one xgrammar
BatchGrammarMatcher call per draft depth (its threads work on several rows at once).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xg

from .grammar_state import GrammarState, Phase


@dataclass
class MaskRequest:
    """One structured sequence in this step: its state, its first logits row, its draft tokens."""

    state: GrammarState
    first_row: int
    drafts: Sequence[int] = ()


@dataclass
class StepMasks:
    """The filled masks of one step.

    bitmask: int32 [num_rows, ceil(vocab_size / 32)] on CPU; bit t of row r set = token t allowed.
    rows: logits rows that must be masked (sorted). Rows not listed are left alone.
    valid_drafts: per MaskRequest, how many leading drafts the grammar accepts.
    """

    bitmask: torch.Tensor
    rows: list[int]
    valid_drafts: list[int] = field(default_factory=list)
    slot: _Slot | None = None


@dataclass
class _Slot:
    """A reusable host buffer and the event of the last device copy made from it."""

    buffer: torch.Tensor
    copy_done: torch.cuda.Event | None = None  # made once, re-recorded per copy (creating one costs ~40 us)
    copy_pending: bool = False


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class BatchMasker:
    """Reusable fill machinery for one LM-head width (keeps a pinned buffer when CUDA exists)."""

    def __init__(self, vocab_size: int, max_threads: int | str = "auto"):
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self._batch = xg.BatchGrammarMatcher(max_threads)
        # Two host buffers used in turn: under asynchronous scheduling the CPU fills step N+1 while
        # step N's non-blocking copy to the device may still be pending; a slot is reused only
        # after the copy made from it has finished.
        self._slots = [_Slot(torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)) for _ in range(2)]
        self._next_slot = 0

    def _take_slot(self, num_rows: int) -> _Slot:
        slot = self._slots[self._next_slot]
        self._next_slot ^= 1
        if slot.copy_pending:
            slot.copy_done.synchronize()
            slot.copy_pending = False
        if slot.buffer.shape[0] < num_rows:
            slot.buffer = torch.empty(
                max(num_rows, 2 * slot.buffer.shape[0]),
                bitmask_words(self.vocab_size),
                dtype=torch.int32,
                pin_memory=torch.cuda.is_available(),
            )
        return slot

    def fill(self, requests: Sequence[MaskRequest], num_rows: int) -> StepMasks:
        """Fill the mask rows of `requests` inside a [num_rows, words] bitmask (the logits' rows).

        Every state is left exactly as it was (drafts are accepted tentatively, then rolled back).
        """
        for req in requests:
            if req.state.vocab_size != self.vocab_size:
                raise ValueError(
                    f"state vocab_size {req.state.vocab_size} != masker vocab_size {self.vocab_size}"
                )
            if not (0 <= req.first_row and req.first_row + len(req.drafts) < num_rows):
                raise ValueError(
                    f"first_row {req.first_row} + {len(req.drafts)} drafts outside [0, {num_rows})"
                )
        slot = self._take_slot(num_rows)
        bitmask = slot.buffer[:num_rows]
        rows: set[int] = set()
        accepted = [0] * len(requests)
        try:
            alive = list(range(len(requests)))
            depth = 0
            while alive:
                # One batched xgrammar call for every live grammar at this draft depth.
                in_grammar = [
                    i
                    for i in alive
                    if requests[i].state.phase is Phase.GRAMMAR
                    and not requests[i].state.matcher.is_terminated()
                ]
                if in_grammar:
                    indices = [requests[i].first_row + depth for i in in_grammar]
                    self._batch.batch_fill_next_token_bitmask(
                        [requests[i].state.matcher for i in in_grammar], bitmask, indices
                    )
                    rows.update(indices)
                grammar_set = set(in_grammar)
                for i in alive:
                    if i not in grammar_set:
                        row = requests[i].first_row + depth
                        if requests[i].state.fill_next_token_bitmask(bitmask, row):
                            rows.add(row)
                still_alive = []
                for i in alive:
                    req = requests[i]
                    if depth == len(req.drafts):
                        continue
                    if req.state.accept_token(req.drafts[depth]):
                        accepted[i] += 1
                        still_alive.append(i)
                        continue
                    # Rejected draft: verification stops here; later rows repeat this row's mask.
                    row = req.first_row + depth
                    for later in range(row + 1, req.first_row + len(req.drafts) + 1):
                        bitmask[later].copy_(bitmask[row])
                        if row in rows:
                            rows.add(later)
                alive = still_alive
                depth += 1
        finally:  # even if xgrammar raises, no tentative draft stays accepted
            for req, count in zip(requests, accepted):
                req.state.rollback(count)
        return StepMasks(bitmask, sorted(rows), accepted, slot)


def apply_bitmask_inplace(logits: torch.Tensor, masks: StepMasks) -> None:
    """Set disallowed logits of the masked rows to -inf, in place, on the logits' device."""
    if not masks.rows:
        return
    if logits.dim() != 2 or logits.shape[0] < masks.bitmask.shape[0]:
        raise ValueError(
            f"logits: expected [>= {masks.bitmask.shape[0]}, vocab] rows, got {tuple(logits.shape)}"
        )
    vocab_size = logits.shape[1]
    if bitmask_words(vocab_size) != masks.bitmask.shape[1]:
        raise ValueError(
            f"logits width {vocab_size} does not match the bitmask "
            f"({masks.bitmask.shape[1]} words); pass the LM-head width as vocab_size"
        )
    if logits.device.type == "cpu":
        # The torch path beats xgrammar's CPU kernel ~7x at 64 x 129k (a byte per table lookup).
        apply_bitmask_torch(logits, masks.bitmask, masks.rows)
        return
    bitmask = masks.bitmask.to(logits.device, non_blocking=True)
    if masks.slot is not None and logits.device.type == "cuda":
        if masks.slot.copy_done is None:
            masks.slot.copy_done = torch.cuda.Event()
        masks.slot.copy_done.record()
        masks.slot.copy_pending = True
    if logits.device.type == "cuda":
        # All leading rows structured (the common all-JSON batch): no index list to build and copy,
        # which costs more than the masking kernel itself.
        n = len(masks.rows)
        dense = masks.rows[-1] == n - 1
        try:
            if dense:
                xg.apply_token_bitmask_inplace(
                    logits[:n], bitmask[:n], vocab_size=vocab_size, backend="triton"
                )
            else:
                xg.apply_token_bitmask_inplace(
                    logits, bitmask, vocab_size=vocab_size, indices=masks.rows, backend="triton"
                )
            return
        except ImportError:  # no triton: fall through to the plain torch version
            pass
    apply_bitmask_torch(logits, bitmask, masks.rows)


# byte value -> its 8 bits as "disallowed" bools, packed into one int64 (8 bool bytes): one int64
# lookup per byte expands the mask (the same scheme as deepinfer_model.sampling, which this package
# may not import). Built per device on first use.
_LUTS: dict[torch.device, torch.Tensor] = {}


def _disallowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is NOT allowed."""
    n, words = bitmask.shape
    if sys.byteorder != "little":
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        return (((bitmask.unsqueeze(-1) >> shifts) & 1) == 0).reshape(n, -1)[:, :vocab_size]
    lut = _LUTS.get(bitmask.device)
    if lut is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        lut = _LUTS[bitmask.device] = (
            (bits == 0).contiguous().view(torch.int64).reshape(256).to(bitmask.device)
        )
    # little-endian: byte j of word w holds tokens 32 w + 8 j .. 32 w + 8 j + 7, lowest bit first
    as_bytes = bitmask.contiguous().view(torch.uint8).reshape(-1)
    return lut.index_select(0, as_bytes.to(torch.int32)).view(torch.bool).view(n, words * 32)[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    return ~_disallowed(bitmask, vocab_size)


_BOUND_LUTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _mask_rows_(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    """x [n, V] = min(x, bound), bound +inf where allowed and -inf elsewhere, built per byte from a
    [256, 8] table in chunks that stay in cache: branch-free, unlike masked_fill_ with a bool mask
    (1.5-3x slower on the CPU, pattern-dependent). A NaN logit at a disallowed token stays NaN."""
    n, vocab = x.shape
    if sys.byteorder != "little":
        x.masked_fill_(_disallowed(bitmask, vocab), float("-inf"))
        return
    key = (x.device, x.dtype)
    lut = _BOUND_LUTS.get(key)
    if lut is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        lut = _BOUND_LUTS[key] = torch.where(bits == 1, float("inf"), float("-inf")).to(x.device, x.dtype)
    words = bitmask.shape[1]
    as_bytes = bitmask.contiguous().view(torch.uint8).view(n, words * 4)
    step = max(1, (1 << 19) // (words * 32)) if x.device.type == "cpu" else n
    for a in range(0, n, step):
        b = min(n, a + step)
        bound = lut.index_select(0, as_bytes[a:b].reshape(-1).to(torch.int32)).view(b - a, words * 32)
        torch.minimum(x[a:b], bound[:, :vocab], out=x[a:b])


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Device-agnostic torch version of the in-place masking (used where no xgrammar kernel fits).
    bitmask rows are the logits' rows (rows not in `rows` are ignored); it may be on another device."""
    if not rows:
        return
    n = len(rows)
    if rows == list(range(rows[0], rows[0] + n)):  # a slice: no gather / scatter
        part = bitmask[rows[0] : rows[0] + n].to(logits.device, non_blocking=True)
        _mask_rows_(logits[rows[0] : rows[0] + n], part)
        return
    index = torch.tensor(rows, dtype=torch.long).to(bitmask.device, non_blocking=True)
    part = bitmask.index_select(0, index).to(logits.device, non_blocking=True)
    index = index.to(logits.device, non_blocking=True)
    sub = logits.index_select(0, index)
    _mask_rows_(sub, part)
    logits.index_copy_(0, index, sub)
