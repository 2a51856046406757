"""Structured output (`SamplingParams.so_args`) through `deepinfer_structured`.

Per sequence a `GrammarState`; every step the emitting rows that are constrained get a token mask
(filled from the state after the previous step's tokens, so it is correct under asynchronous
scheduling too) kept packed as xgrammar fills it (int32, 32 tokens a word) until the sampler applies
it in place to those rows only; the sampler draws only allowed tokens, and the committed token is
fed back to the state. A grammar violation or a compile error fails that request alone.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer_model import TokenBitmask

from .. import envs


class StructuredOutputs:
    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_token_id: int | None) -> None:
        import deepinfer_structured as ds

        self._ds = ds
        info = ds.tokenizer_info_from_file(
            Path(tokenizer_dir) / "tokenizer.json",
            vocab_size=vocab_size,
            stop_token_ids=None if eos_token_id is None else [eos_token_id],
        )
        self.vocab_size = vocab_size
        self.compiler = ds.GrammarCompileService(info, timeout_s=float(envs.DEEPINFER_XGRAMMAR_TIMEOUT))
        self.masker = ds.BatchMasker(vocab_size)

    def new_state(self, so_args: dict):
        """A fresh grammar state; raises ValueError (StructuredOutputError) naming what is wrong."""
        return self.compiler.new_state(so_args)

    def allowed_rows(self, states: dict[int, object], num_rows: int) -> TokenBitmask | None:
        """Packed allowed-token masks of the constrained rows among `states` ({batch row: state});
        None when no row restricts anything."""
        if not states:
            return None
        requests = [self._ds.MaskRequest(state, row) for row, state in states.items()]
        return self._packed(self.masker.fill(requests, num_rows=num_rows))

    def allowed_rows_with_drafts(
        self, requests: list[tuple[object, int, list[int]]], num_rows: int
    ) -> TokenBitmask | None:
        """requests: (state, first row, drafts) — masks for the next token and for the token after
        each draft prefix (rows first_row .. first_row + len(drafts)); states are left unchanged."""
        if not requests:
            return None
        masks = self.masker.fill(
            [self._ds.MaskRequest(state, row, list(drafts)) for state, row, drafts in requests],
            num_rows=num_rows,
        )
        return self._packed(masks)

    @staticmethod
    def _packed(masks) -> TokenBitmask | None:
        if not masks.rows:
            return None
        # The masker reuses its host buffer two fills later: keep our own copy of the used rows
        # (a slice when they are the leading rows, the usual all-structured batch; else a gather).
        n = len(masks.rows)
        if masks.rows[-1] == n - 1:
            bitmask = masks.bitmask[:n].clone()
        else:
            bitmask = masks.bitmask[masks.rows]
        return TokenBitmask(bitmask, tuple(masks.rows))

    def accept(self, state, token: int) -> None:
        state.accept_verified([token])

    def accept_many(self, state, tokens: list[int]) -> None:
        """The verified drafts + the final token of a step (all or nothing)."""
        state.accept_verified(list(tokens))

    def close(self) -> None:
        self.compiler.shutdown()
