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
class Logprob:
    """One token's log-probability under the model (raw logits: before temperature, top-p / top-k
    and masks), its rank in the vocabulary (1 = most likely) and its text on its own."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, {token id: Logprob}: the chosen token and the `logprobs` most likely alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position, the same for the prompt's own token; None for the first (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # When `logprobs` was requested (vLLM's form): per generated token, the chosen token and the top
    # `num_logprobs` alternatives. Ranks of the alternatives are their places 1..num_logprobs; the chosen
    # token, when not among them, ranks after them (ties go to the listed ones).
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs (when requested)
    # "stop", "length", "abort", "error", "prompt_length_exceeded", "insufficient_system_resource"
    # (preempted and not recomputed: EngineArgs.stop_preempted_request)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_logprobs: int | None = None  # the alternatives asked for per position (SamplingParams.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_logprobs(self) -> list[float] | None:
        """The chosen token's log-probability at each position."""
        if self.logprobs is None:
            return None
        return [d[t].logprob for t, d in zip(self.token_ids, self.logprobs)]

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        """The top alternatives at each position as {token id: logprob}, most likely first."""
        if self.logprobs is None:
            return None
        k = self.num_logprobs or 0
        return [
            {t: lp.logprob for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank) if lp.rank <= k}
            for d in self.logprobs
        ]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    error: str | None = None  # set when this request failed alone (bad input); outputs are then empty
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs is set

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
            "prompt_logprobs": _jsonable(self.prompt_logprobs),
            "outputs": [_completion_json(o) for o in self.outputs],
            "metrics": asdict(self.metrics) | {"ttft_s": self.metrics.ttft, "tpot_s": self.metrics.tpot},
        }


def _completion_json(o: CompletionOutput) -> dict:
    return {
        "index": o.index,
        "text": o.text,
        "token_ids": o.token_ids,
        "logprobs": _jsonable(o.logprobs),
        "cumulative_logprob": o.cumulative_logprob,
        "finish_reason": o.finish_reason,
        "stop_reason": o.stop_reason,
    }


def _jsonable(positions: list[dict[int, Logprob] | None] | None):
    """JSON has string keys only: {"token id": {"logprob", "rank", "decoded_token"}} per position."""
    if positions is None:
        return None
    return [None if d is None else {str(t): asdict(lp) for t, lp in d.items()} for d in positions]
