"""Request admission and request state: the requests the engine holds, their sequences, and what the
scheduler must be told to forget.

A request enters with `add` (grammar compiled, seeds drawn, its `n` sequences handed to the
scheduler: all or none) and leaves once every sequence has finished (`collect`): its output waits in
`done` for the next `step()` to return it. The scheduler forgets a finished sequence one step late
(`pending_release`): under asynchronous scheduling the step in flight may still name it.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from . import scheduling
from .bad_words import bad_words_token_ids
from .dp_balance import request_cost
from .request import RequestState, SeqState
from .structured import StructuredOutputs
from .truncation import Truncation


class SequenceTracker(Protocol):
    """Per-sequence state kept beside the table (speculative decoding's drafts)."""

    def add(self, seq_id: int, seed: int) -> None: ...

    def remove(self, seq_id: int) -> None: ...


class RequestTable:
    def __init__(
        self,
        scheduler,
        tokenizer: Tokenizer,
        tokenizer_dir: Path,
        truncation: Truncation,
        *,
        seed: int | None,
        vocab_size: int,
        eos_token_id: int | None,
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.truncation = truncation
        self.vocab_size, self.eos_token_id, self.max_model_len = vocab_size, eos_token_id, max_model_len
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[int, SeqState] = {}
        self.done: list[RequestOutput] = []  # finished, not yet returned by step()
        self.pending_release: list[int] = []  # finished sequences the scheduler still remembers
        self.prompt_len_of: dict[int, int] = {}  # seq_id -> ORIGINAL prompt length, until released
        self.structured: StructuredOutputs | None = None  # built on the first so_args request
        self.tracker: SequenceTracker | None = None
        self._tokenizer_dir = tokenizer_dir
        self._seed_rng = random.Random(seed)
        self._next_seq_id = 0

    def check_new(self, request_id: str, params: SamplingParams) -> None:
        """What is wrong with the request before its prompt is even read (ValueError)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.truncation.check_request(params.prompt_logprobs is not None)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        seeds: list[int] | None = None,
        cached_blocks: list[list[int]] | None = None,
        images=None,
    ) -> None:
        """Admit a checked prompt; raises ValueError and leaves nothing behind when it cannot.
        cached_blocks: per sample, the blocks already holding its prompt (a COMPLETION engine).
        `images`: the `images.ImagePrompt` the prompt was expanded from (a request with images)."""
        if cached_blocks is not None and len(cached_blocks) != params.n:
            raise ValueError(f"cached_blocks has {len(cached_blocks)} block lists for n={params.n} samples")
        grammars = [None] * params.n
        if params.so_args is not None:
            if self.structured is None:
                self.structured = StructuredOutputs(self._tokenizer_dir, self.vocab_size, self.eos_token_id)
            grammars = [self.structured.new_state(params.so_args) for _ in range(params.n)]
        seeds = self._seeds(params, seeds)
        seq_ids = list(range(self._next_seq_id, self._next_seq_id + params.n))
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, self.tokenizer, seq_ids, seeds, arrival_time
        )
        state.set_images(images)
        state.bad_words = bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size)
        for seq, grammar in zip(state.seqs, grammars):
            seq.grammar = grammar
            if self.tracker is not None:
                self.tracker.add(seq.seq_id, seq.seed)
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        salt = self.truncation.cache_salt(len(prompt_token_ids))
        if images is not None:  # blocks are shared only between requests with the same images
            salt = images.cache_salt(salt)
        if params.prompt_logprobs is not None:
            # a namespace of its own: a prefix found in the cache would not be computed, its rows unscored
            salt = _own_cache_salt(salt, seq_ids[0])
        self._next_seq_id += params.n
        added: list[int] = []
        try:
            for i, seq in enumerate(state.seqs):
                scheduling.add_sequence(
                    self.scheduler,
                    seq.seq_id,
                    prompt_token_ids,
                    params,
                    self.eos_token_id,
                    max_tokens,
                    cache_salt=salt,
                    cached_block_ids=None if cached_blocks is None else cached_blocks[i],
                )
                added.append(seq.seq_id)
                self.prompt_len_of[seq.seq_id] = len(prompt_token_ids)
        except ValueError:  # leave nothing of this request behind in the scheduler
            for seq_id in added:
                scheduling.abort(self.scheduler, seq_id)
                self.pending_release.append(seq_id)
            if self.tracker is not None:
                for seq in state.seqs:
                    self.tracker.remove(seq.seq_id)
            raise
        self.requests[request_id] = state
        for seq in state.seqs:
            self.seqs[seq.seq_id] = seq

    def _seeds(self, params: SamplingParams, seeds: list[int] | None) -> list[int]:
        """The n samples' seeds: from seq_seed, else the ones given (a data-parallel front draws them
        from one stream for all ranks), else this engine's seed stream."""
        if seeds is None or params.seq_seed is not None:
            return [
                (params.seq_seed + i) & (2**64 - 1)
                if params.seq_seed is not None
                else self._seed_rng.getrandbits(64)
                for i in range(params.n)
            ]
        if len(seeds) != params.n:
            raise ValueError(f"seeds has {len(seeds)} entries for n={params.n} samples")
        return seeds

    def abort(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        if state is None:
            return False
        self._end(state, "abort")
        return True

    def tokens_left(self) -> tuple[int, int]:
        """Tokens still to compute for the requests held (`dp_balance.request_cost` of every unfinished
        sample less what the scheduler has computed of it), and of those in requests `withdraw` takes."""
        queued = movable = 0
        for state in self.requests.values():
            total = request_cost(len(state.prompt_token_ids), state.params.max_tokens, 1, self.max_model_len)
            left, unstarted = 0, state.params.so_args is None
            for seq in state.seqs:
                if not seq.finished:
                    left += max(0, total - scheduling.num_computed_tokens(self.scheduler, seq.seq_id))
                    unstarted = unstarted and scheduling.is_unstarted(self.scheduler, seq.seq_id)
            queued += left
            movable += left if unstarted else 0
        return queued, movable

    def withdraw(self, request_id: str) -> RequestState | None:
        """Take back a request none of whose sequences has started (`scheduling.is_unstarted`) and
        forget it without an output, so that another engine can serve it from the start; None (and
        nothing changed) when it has started, has a grammar or images (its expanded prompt is nothing
        without them), or is not here."""
        state = self.requests.get(request_id)
        if (
            state is None
            or state.params.so_args is not None
            or state.images is not None
            or not all(scheduling.is_unstarted(self.scheduler, seq.seq_id) for seq in state.seqs)
        ):
            return None
        del self.requests[request_id]
        for seq in state.seqs:
            scheduling.abort(self.scheduler, seq.seq_id)
            self.seqs.pop(seq.seq_id, None)
            self.pending_release.append(seq.seq_id)
            if self.tracker is not None:
                self.tracker.remove(seq.seq_id)
        return state

    def fail(self, request_id: str, message: str) -> None:
        state = self.requests[request_id]
        state.error = message
        self._end(state, "error")

    def fail_seq(self, seq_id: int, message: str) -> None:
        """Fail the request of a sequence named by a step, unless it has already left."""
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.request.request_id in self.requests:
            self.fail(seq.request.request_id, message)

    def _end(self, state: RequestState, reason: str) -> None:
        for seq in state.seqs:
            if not seq.finished:
                scheduling.abort(self.scheduler, seq.seq_id)
                seq.finish(reason)
        self.collect(state)

    def collect(self, state: RequestState) -> None:
        """A finished request leaves: its output waits in `done`, its sequences for release."""
        if state.finished and self.requests.pop(state.request_id, None) is not None:
            for seq in state.seqs:
                self.seqs.pop(seq.seq_id, None)
                self.pending_release.append(seq.seq_id)
                if self.tracker is not None:
                    self.tracker.remove(seq.seq_id)
            self.done.append(state.to_output())

    def collect_all(self) -> None:
        for state in [s for s in self.requests.values() if s.finished]:
            self.collect(state)

    def release_pending(self) -> None:
        """The scheduler forgets the sequences that finished before the step just committed."""
        releasable, self.pending_release = self.pending_release, []
        for seq_id in releasable:
            scheduling.release(self.scheduler, seq_id)
            self.prompt_len_of.pop(seq_id, None)

    def release_idle(self, steps_in_flight: bool) -> None:
        """Nothing ran this step: collect, and release every finished sequence unless a step in
        flight may still name it."""
        self.collect_all()
        if not steps_in_flight:
            self.release_pending()

    def take_done(self) -> list[RequestOutput]:
        done, self.done = self.done, []
        return done

    def close(self) -> None:
        if self.structured is not None:
            self.structured.close()
            self.structured = None


def _own_cache_salt(salt: int, seq_id: int) -> int:
    """A prefix-cache namespace no other request shares (the table's sequence ids never repeat)."""
    digest = hashlib.sha256(f"prompt-logprobs:{salt}:{seq_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
