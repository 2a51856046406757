"""Engine-side state of one request: its `n` sequences, their text, stops and metrics.

The scheduler knows tokens and blocks; this side knows what the user sees: incremental text, stop
strings and stop token ids (which end a sequence here, then in the scheduler), logprobs, timings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from ..detokenizer import IncrementalDetokenizer, find_stop
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams


def logprob_entry(
    token_id: int, logprob: float, rank: int, top: dict[int, float], k: int, decode
) -> dict[int, Logprob]:
    """vLLM's per-position dict: the scored token first, then the k alternatives ranked by place; a
    scored token outside them ranks after them (ties go to the listed ones)."""
    places = {t: place for place, t in enumerate(top, start=1)}
    rank = places.get(token_id, max(rank, k + 1) if k else rank)
    entry = {token_id: Logprob(logprob, rank, decode(token_id))}
    for t, value in top.items():
        if t != token_id:
            entry[t] = Logprob(value, places[t], decode(t))
    return entry


@dataclass
class SeqState:
    seq_id: int
    index: int  # which of the request's n samples
    seed: int
    request: RequestState
    detok: IncrementalDetokenizer
    output: CompletionOutput
    token_ids: list[int] = field(default_factory=list)  # prompt + generated so far (model input)
    grammar: object | None = None  # deepinfer_structured.GrammarState when so_args is set
    # The asynchronous loop builds the next step between committing a token to the scheduler and
    # appending it here: that token, for the logits processors that read the seen tokens.
    committed_ahead: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.output.token_ids)

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        if self.output.finish_reason is None:
            if reason != "stop":  # stop handling already cut the text; otherwise emit what is pending
                self.detok.flush()
                self.output.text = self.detok.text
            self.output.finish_reason = reason
            self.output.stop_reason = stop_reason
            self.request.on_seq_finished()

    def append(
        self,
        token_id: int,
        eos_token_id: int | None,
        max_model_len: int,
        logprob: float | None = None,
        top: dict[int, float] | None = None,
        rank: int | None = None,
    ) -> None:
        """Record one generated token and decide whether the sequence ends with it. logprob / rank:
        the token's raw log-probability and 1 + the number of tokens more likely; top: the requested
        alternatives, most likely first."""
        if self.finished:
            return
        p = self.request.params
        now = time.perf_counter()
        if self.request.metrics.first_token_time is None:
            self.request.metrics.first_token_time = now
        self.token_ids.append(token_id)
        out = self.output
        out.token_ids.append(token_id)
        self.request.metrics.num_output_tokens += 1
        if out.logprobs is not None:
            out.logprobs.append(self._logprob_entry(token_id, logprob, rank, top or {}))
            out.cumulative_logprob += logprob

        if token_id == eos_token_id and not p.ignore_eos:
            self._emit_text(token_id, skip=True)
            self.finish("stop", token_id)
            return
        if token_id in p.stop_token_ids:
            self._emit_text(token_id, skip=True)
            self.finish("stop", token_id)
            return
        self._emit_text(token_id)
        if self.finished:
            return
        if len(out.token_ids) >= p.max_tokens:
            self.finish("length")
        elif len(self.token_ids) >= max_model_len:
            self.finish("length")

    def _logprob_entry(self, token_id: int, logprob: float, rank: int, top: dict[int, float]) -> dict:
        return logprob_entry(
            token_id, logprob, rank, top, self.output.num_logprobs or 0, self.detok.decode_one
        )

    def _emit_text(self, token_id: int, skip: bool = False) -> None:
        p = self.request.params
        if skip:  # stop tokens are not part of the text (they stay in token_ids)
            self.detok.flush()
            self.output.text = self.detok.text
            return
        delta = self.detok.add(token_id)
        text = self.detok.text
        if delta and p.stop:
            hit = find_stop(text, len(delta), p.stop)
            if hit is not None:
                start, stop = hit
                self.output.text = text[: start + len(stop)] if p.include_stop_str_in_output else text[:start]
                self.finish("stop", stop)
                return
        self.output.text = text


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        seq_ids: list[int],
        seeds: list[int],
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = RequestMetrics(
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            num_prompt_tokens=len(prompt_token_ids),
        )
        self.num_unfinished = len(seq_ids)
        self.error: str | None = None
        # position p (>= 1): the prompt token's logprob given tokens 0..p-1; filled by the prefill (an
        # image sentinel position stays None: no vocabulary token to score)
        self.prompt_logprobs: list | None = None
        self._prompt_positions_missing = 0
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_token_ids)
            self._prompt_positions_missing = len(prompt_token_ids) - 1
        # the logits processors' inputs the engine resolves at admission (`RequestTable.add`)
        self.bad_words: tuple[tuple[int, ...], ...] = ()
        self._prompt_tuple: tuple[int, ...] | None = None
        self.images = None  # `images.ImagePrompt` of a request with images
        self.seqs: list[SeqState] = []
        for index, (seq_id, seed) in enumerate(zip(seq_ids, seeds)):
            out = CompletionOutput(index=index)
            if params.logprobs is not None:
                out.logprobs, out.cumulative_logprob, out.num_logprobs = [], 0.0, params.logprobs
            self.seqs.append(
                SeqState(
                    seq_id=seq_id,
                    index=index,
                    seed=seed,
                    request=self,
                    detok=IncrementalDetokenizer(tokenizer, params.skip_special_tokens),
                    output=out,
                    token_ids=list(prompt_token_ids),
                )
            )

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self._prompt_positions_missing > 0

    def set_images(self, images) -> None:
        """The `images.ImagePrompt` the prompt was expanded from: its sentinel positions are not scored."""
        self.images = images
        if images is not None and self.prompt_logprobs is not None:
            self._prompt_positions_missing -= int(images.sentinel[1:].sum())

    def add_prompt_rows(self, rows, decode) -> None:
        """Scored prompt rows of a prefill chunk (`prompt_logprobs.PromptRows`); a position scored
        twice (n sequences, a recompute) keeps its first entry, which is the same. Image sentinel
        positions are left out."""
        k = self.params.prompt_logprobs or 0
        sentinel = None if self.images is None else self.images.sentinel
        for j, token in enumerate(rows.token_ids):
            position = rows.first_position + j
            if sentinel is not None and sentinel[position]:
                continue
            if self.prompt_logprobs[position] is None:
                self.prompt_logprobs[position] = logprob_entry(
                    token, rows.logprobs[j], rows.ranks[j], rows.top[j], k, decode
                )
                self._prompt_positions_missing -= 1

    @property
    def reads_seen_tokens(self) -> bool:
        """Whether a row's sampling depends on the tokens before it (penalties, bad words of several
        tokens): its rows carry those tokens, and the asynchronous loop builds them once the previous
        step's tokens are known."""
        return self.params.reads_seen_tokens or any(len(w) > 1 for w in self.bad_words)

    @property
    def prompt_tuple(self) -> tuple[int, ...]:
        """The prompt as the (immutable, shared) tuple every row of the request carries."""
        if self._prompt_tuple is None:
            ids = self.prompt_token_ids
            if self.images is not None:  # image sentinels are no vocabulary token a penalty could hit
                ids = [t for t, s in zip(ids, self.images.sentinel, strict=True) if not s]
            self._prompt_tuple = tuple(ids)
        return self._prompt_tuple

    def on_seq_finished(self) -> None:
        self.num_unfinished -= 1
        if self.num_unfinished == 0:
            self.metrics.finish_time = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[s.output for s in self.seqs],
            metrics=self.metrics,
            error=self.error,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )
