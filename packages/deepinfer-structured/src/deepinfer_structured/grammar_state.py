"""Per-request grammar state: an xgrammar matcher plus the reference's trigger / bound phases.

Phases (spec §8): FREE until the trigger token sequence has been emitted (any token allowed);
FORCING after the bound token: the rest of the trigger is forced token by token; GRAMMAR: the
compiled grammar decides; once it has accepted a stop token, later tokens are free again (only
reachable with ignore_eos). Without a trigger the state starts in GRAMMAR.

Every accepted token pushes one history entry, so `rollback(n)` is exact across phase changes,
and `rebuild_from_tokens` replays a whole output after preemption + recompute.
"""

from __future__ import annotations

from enum import Enum

import torch
import xgrammar as xg

from .errors import StructuredOutputError
from .so_args import StructuredOutputRequest

_ALL_ALLOWED = -1  # an int32 word with all 32 bits set


class Phase(Enum):
    FREE = "free"
    FORCING = "forcing"
    GRAMMAR = "grammar"


class GrammarState:
    """One request's structured-output state. Not thread-safe (one engine loop owns it)."""

    def __init__(
        self,
        compiled: xg.CompiledGrammar,
        request: StructuredOutputRequest,
        never_tokens: frozenset[int] | None = None,
    ):
        """never_tokens: the tokenizer's special token ids, when the caller has them already (reading
        them from xgrammar costs ~3 ms at the 129k vocabulary: GrammarCompileService keeps one copy)."""
        self.request = request
        info = compiled.tokenizer_info
        self.vocab_size = info.vocab_size
        self.matcher = xg.GrammarMatcher(compiled)
        # Tokens no grammar can accept. Checked here because xgrammar logs a warning line for each
        # one it is offered, and drafts offer them often.
        self._never = frozenset(info.special_token_ids) if never_tokens is None else never_tokens
        self._trigger = request.trigger_token_ids
        self._bound = request.bound_token_id
        # In the grammar phase all trigger tokens are matched, so these entries never vary.
        self._grammar_entry = (Phase.GRAMMAR, len(self._trigger), True)
        self._after_end_entry = (Phase.GRAMMAR, len(self._trigger), False)
        self._reset_phase()

    def _reset_phase(self) -> None:
        self.phase = Phase.FREE if self._trigger else Phase.GRAMMAR
        self._matched = 0  # trigger tokens matched so far (FREE / FORCING)
        # Per accepted token: (phase before, matched before, whether the matcher consumed it).
        self._history: list[tuple[Phase, int, bool]] = []

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens accepted since the start (what `rollback` can undo)."""
        return len(self._history)

    @property
    def constrained(self) -> bool:
        """Whether the next token is restricted (forced trigger token or live grammar)."""
        return self.phase is Phase.FORCING or (
            self.phase is Phase.GRAMMAR and not self.matcher.is_terminated()
        )

    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: the structured output is complete."""
        return self.phase is Phase.GRAMMAR and self.matcher.is_terminated()

    def can_terminate(self) -> bool:
        """A stop token would be accepted now (the output so far is a complete match)."""
        return self.phase is Phase.GRAMMAR and self.matcher.is_completed()

    # ---- masks ---------------------------------------------------------------------------------
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed-token bits for the next token into `bitmask[row]` (int32, CPU).

        Returns whether the row restricts anything (False: all allowed, applying can be skipped).
        """
        if self.phase is Phase.FORCING:
            bitmask[row].zero_()
            self._set_bit(bitmask, row, self._trigger[self._matched])
            return True
        if self.phase is Phase.GRAMMAR and not self.matcher.is_terminated():
            return bool(self.matcher.fill_next_token_bitmask(bitmask, row))
        bitmask[row].fill_(_ALL_ALLOWED)
        return False

    @staticmethod
    def _set_bit(bitmask: torch.Tensor, row: int, token: int) -> None:
        word, bit = divmod(token, 32)
        value = (1 << bit) if bit < 31 else -(1 << 31)  # keep it inside int32
        bitmask[row, word] = int(bitmask[row, word]) | value

    def fill_draft_bitmasks(self, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> int:
        """Rows first_row .. first_row+len(drafts): the mask for the next token and for the token
        after each draft prefix. Drafts are accepted tentatively and rolled back before returning,
        so the state is unchanged. Returns how many leading drafts the grammar accepts; the rows
        after the first rejected draft repeat the mask that rejects it (verification stops there).
        """
        need_apply = self.fill_next_token_bitmask(bitmask, first_row)
        accepted = 0
        for draft in drafts:
            if not self.accept_token(draft):
                break
            accepted += 1
            need_apply = self.fill_next_token_bitmask(bitmask, first_row + accepted) or need_apply
        for row in range(first_row + accepted + 1, first_row + len(drafts) + 1):
            bitmask[row].copy_(bitmask[first_row + accepted])
        self.rollback(accepted)
        return accepted

    # ---- state changes -------------------------------------------------------------------------
    def accept_token(self, token: int) -> bool:
        """Advance by one emitted token; False (state unchanged) if the constraint forbids it."""
        if self.phase is Phase.GRAMMAR:  # the hot path: one C++ call, one shared history entry
            if self.matcher.is_terminated():
                self._history.append(self._after_end_entry)
                return True
            if (
                token in self._never
                or not 0 <= token < self.vocab_size
                or not self.matcher.accept_token(token)
            ):
                return False
            self._history.append(self._grammar_entry)
            return True
        before = (self.phase, self._matched)
        if self.phase is Phase.FORCING:
            if token != self._trigger[self._matched]:
                return False
            self._matched += 1
        else:
            self._matched = self._advance_match(self._matched, token)
            if token == self._bound and self._matched < len(self._trigger):
                self.phase = Phase.FORCING
        if self._matched == len(self._trigger):
            self.phase = Phase.GRAMMAR
        self._history.append((*before, False))
        return True

    def _advance_match(self, matched: int, token: int) -> int:
        """Longest trigger prefix that is a suffix of (matched trigger prefix + token) (KMP step)."""
        seq = self._trigger[:matched] + (token,)
        for length in range(min(len(seq), len(self._trigger)), 0, -1):
            if seq[len(seq) - length :] == self._trigger[:length]:
                return length
        return 0

    def accept_verified(self, tokens: list[int]) -> None:
        """Advance by the tokens a step produced (verified drafts + the bonus token).

        Raises StructuredOutputError if one is forbidden (the sampler ignored the mask); the state
        is then left where it was before the call, and the request should fail.
        """
        for i, token in enumerate(tokens):
            if not self.accept_token(token):
                step = self.num_tokens + 1
                self.rollback(i)
                raise StructuredOutputError(
                    "schema", f"token {token} at output step {step} violates the constraint"
                )

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens exactly."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"num_tokens: must be in [0, {len(self._history)}], got {num_tokens}")
        if num_tokens == 0:
            return
        undone = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        self.phase, self._matched, _ = undone[0]  # the state before the earliest undone token
        fed = sum(entry[2] for entry in undone)
        if fed:
            self.matcher.rollback(fed)

    def rebuild_from_tokens(self, emitted: list[int]) -> None:
        """Reset and replay a request's whole output (after preemption by recompute)."""
        self.matcher.reset()
        self._reset_phase()
        self.accept_verified(list(emitted))
