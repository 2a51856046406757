"""StructuredOutputManager: everything the engine loop needs, keyed by request id.

It keeps the "one bad request fails alone" rule in one place: validation errors raise at
`add_request`; compile errors, timeouts, a token the grammar rejects, or an xgrammar exception while
filling masks come back as {request_id: StructuredOutputError} and the request is dropped here, so
the engine only has to finish those requests as failed (the reference's SO_FAILED).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import xgrammar as xg

from .batch import BatchMasker, MaskRequest, StepMasks, apply_bitmask_inplace, bitmask_words
from .compiler import GrammarCompileService, PendingGrammar
from .errors import StructuredOutputError
from .grammar_state import GrammarState


class StructuredOutputManager:
    """Compile service + per-request states + batch masks for one engine."""

    def __init__(
        self,
        tokenizer_info: xg.TokenizerInfo,
        *,
        compile_threads: int = 2,
        timeout_s: float = 20.0,
        cache_entries: int = 256,
        cache_limit_bytes: int = 10 << 30,
        fill_threads: int | str = "auto",
    ):
        self.compiler = GrammarCompileService(
            tokenizer_info,
            max_threads=compile_threads,
            timeout_s=timeout_s,
            cache_entries=cache_entries,
            cache_limit_bytes=cache_limit_bytes,
        )
        self.masker = BatchMasker(tokenizer_info.vocab_size, max_threads=fill_threads)
        self._pending: dict[Hashable, PendingGrammar] = {}
        self._states: dict[Hashable, GrammarState] = {}

    # ---- request lifecycle -----------------------------------------------------------------------
    def add_request(self, request_id: Hashable, so_args: dict) -> None:
        """Validate and start compiling. Raises StructuredOutputError for a bad request."""
        if request_id in self._pending or request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already registered")
        self._pending[request_id] = self.compiler.submit(so_args)

    def poll(self) -> dict[Hashable, StructuredOutputError]:
        """Attach finished compiles; return (and forget) the requests whose compile failed or timed out."""
        failed: dict[Hashable, StructuredOutputError] = {}
        for request_id, pending in list(self._pending.items()):
            try:
                compiled = pending.poll()
            except StructuredOutputError as exc:
                failed[request_id] = exc
                del self._pending[request_id]
                continue
            if compiled is not None:
                self._states[request_id] = GrammarState(compiled, pending.request, self.compiler.never_tokens)
                del self._pending[request_id]
        return failed

    def is_ready(self, request_id: Hashable) -> bool:
        """Whether the request may be scheduled (compiled). Pending requests count as unfinished."""
        return request_id in self._states

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def state(self, request_id: Hashable) -> GrammarState:
        return self._states[request_id]

    def remove(self, request_id: Hashable) -> None:
        """Forget a finished / aborted request (no error if unknown)."""
        self._pending.pop(request_id, None)
        self._states.pop(request_id, None)

    # ---- per step --------------------------------------------------------------------------------
    def fill(
        self, rows: Sequence[tuple[Hashable, int, Sequence[int]]], num_rows: int
    ) -> tuple[StepMasks, dict[Hashable, StructuredOutputError]]:
        """Masks for (request_id, first_row, drafts) of the structured requests in this step.

        If xgrammar raises, each request is retried alone so that only the broken one fails.
        """
        requests = [MaskRequest(self._states[rid], first, list(drafts)) for rid, first, drafts in rows]
        try:
            return self.masker.fill(requests, num_rows), {}
        except StructuredOutputError:
            raise
        except Exception:  # noqa: BLE001 - isolate the request whose matcher broke
            return self._fill_one_by_one(rows, requests, num_rows)

    def _fill_one_by_one(self, rows, requests, num_rows):
        bitmask = torch.full((num_rows, bitmask_words(self.masker.vocab_size)), -1, dtype=torch.int32)
        masked: list[int] = []
        valid: list[int] = []
        failed: dict[Hashable, StructuredOutputError] = {}
        for (rid, first, drafts), req in zip(rows, requests):
            try:
                valid.append(req.state.fill_draft_bitmasks(list(drafts), bitmask, first))
                masked.extend(range(first, first + len(drafts) + 1))
            except Exception as exc:  # noqa: BLE001
                bitmask[first : first + len(drafts) + 1] = -1
                valid.append(0)
                failed[rid] = StructuredOutputError("schema", f"grammar matcher failed: {exc}")
                self.remove(rid)
        return StepMasks(bitmask, sorted(masked), valid), failed

    @staticmethod
    def apply(logits: torch.Tensor, masks: StepMasks) -> None:
        apply_bitmask_inplace(logits, masks)

    def accept(self, request_id: Hashable, tokens: Sequence[int]) -> StructuredOutputError | None:
        """Advance by this step's tokens (accepted drafts + bonus). On a violation the request is
        dropped and the error returned."""
        try:
            self._states[request_id].accept_verified(list(tokens))
        except StructuredOutputError as exc:
            self.remove(request_id)
            return exc
        return None

    def rebuild(self, request_id: Hashable, emitted: Sequence[int]) -> StructuredOutputError | None:
        """After preemption by recompute: replay the emitted tokens (drops the request on failure)."""
        try:
            self._states[request_id].rebuild_from_tokens(list(emitted))
        except StructuredOutputError as exc:
            self.remove(request_id)
            return exc
        return None

    def is_terminated(self, request_id: Hashable) -> bool:
        return self._states[request_id].is_terminated()
