"""One request's outputs as a stream: cumulative snapshots of its completions, taken between engine steps.

A snapshot copies what the engine holds for the request (text, token ids, logprobs, finish reason), so a
consumer may keep it while the engine moves on. The text of an unfinished completion with stop strings
is held back by the longest stop string less one character: a stop string that the next token completes
removes text the engine already shows, and a stream must never take back what it sent.
"""

from __future__ import annotations

import asyncio
import copy

from .outputs import CompletionOutput, RequestOutput


def visible_text(output: CompletionOutput, stop: list[str]) -> str:
    """The part of `output.text` no later token can cut away."""
    if output.finished or not stop:
        return output.text
    hold = max(len(s) for s in stop) - 1
    return output.text[: max(0, len(output.text) - hold)]


def snapshot(state) -> RequestOutput:
    """A `RequestOutput` of an engine `RequestState` as it is now (its lists copied)."""
    stop = state.params.stop
    outputs = [
        CompletionOutput(
            index=o.index,
            text=visible_text(o, stop),
            token_ids=list(o.token_ids),
            logprobs=None if o.logprobs is None else list(o.logprobs),
            cumulative_logprob=o.cumulative_logprob,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            num_logprobs=o.num_logprobs,
        )
        for o in (s.output for s in state.seqs)
    ]
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=outputs,
        metrics=copy.copy(state.metrics),
        error=state.error,
        prompt_logprobs=None if state.prompt_logprobs is None else list(state.prompt_logprobs),
    )


def num_tokens(out: RequestOutput) -> int:
    return sum(len(o.token_ids) for o in out.outputs)


class RequestStream:
    """`async for out in stream`: the request's cumulative outputs, the last one finished.

    The producer only ever replaces the latest snapshot, so a slow consumer skips intermediate ones
    (nothing is lost: each snapshot holds everything before it) and memory stays bounded.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False  # the final output was produced (not necessarily consumed)
        self.tokens_seen = 0  # tokens in the latest snapshot
        self.last_delivery: float | None = None  # perf_counter time tokens last arrived
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._ended = False  # the consumer got the final output (or the error)

    def put(self, out: RequestOutput) -> None:
        if self.finished:
            return
        self._latest = out
        self.finished = out.finished
        self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self._error, self.finished = error, True
            self._event.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            self._ended = True
            raise self._error
        out = self._latest
        self._ended = out.finished
        return out
