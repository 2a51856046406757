"""What `LLM.generate` returns: one `RequestOutput` per prompt, holding `n` completions."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Speculative decoding (0 when off): drafts verified for / accepted by this request's sequences.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token (s): arrival to the first sampled token of any completion."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token (s) after the first one, averaged over all completions' tokens."""
        if self.first_token_time is None or self.finish_time is None or self.num_output_tokens <= 1:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Per generated token, when logprobs were requested: the chosen token's log-probability and a
    # {token_id: logprob} dict of the top alternatives.
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    # "stop", "length", "abort", "error", "prompt_length_exceeded", "insufficient_system_resource"
    # (preempted and not recomputed: EngineArgs.stop_preempted_request)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    error: str | None = None  # set when this request failed alone (bad input); outputs are then empty

    @property
    def finished(self) -> bool:
        return self.error is not None or all(o.finished for o in self.outputs)

    def to_json(self) -> dict:
        """A JSON-serialisable record (used by `deepinfer generate --output`)."""
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "error": self.error,
            "outputs": [asdict(o) | {"top_logprobs": _jsonable_top(o.top_logprobs)} for o in self.outputs],
            "metrics": asdict(self.metrics) | {"ttft_s": self.metrics.ttft, "tpot_s": self.metrics.tpot},
        }


def _jsonable_top(top: list[dict[int, float]] | None):
    return None if top is None else [{str(k): v for k, v in d.items()} for d in top]
