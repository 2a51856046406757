"""`SamplingParams`: how each request is decoded (the reference's fields plus what vLLM users expect)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer_model import MAX_LOGPROBS, normalize_seed, validate_sampling_fields

INT32_MAX = 2**31 - 1


@dataclass
class SamplingParams:
    """Per-request decoding parameters. Invalid values raise a `ValueError` naming the field.

    temperature 0 means greedy (argmax, lowest id on ties). Transform order: temperature, top-p,
    top-k (reference order), then min-p. With `seq_seed` set, each token's draw is a pure function of
    (seq_seed, position), so the output does not depend on what else runs in the batch; sample i of
    `n` uses seed `seq_seed + i`. Without it the engine derives a seed from its own seeded generator.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # logprob of each chosen token plus this many top alternatives
    top_logprobs: int = 0  # reference name: number of top alternatives (implies logprobs)
    # Per prompt token, its logprob and this many top alternatives (vLLM's int; the reference's
    # boolean: True = 0 alternatives, False = off); computed from the prefill's logits.
    prompt_logprobs: int | bool | None = None
    first_n_token_no_eos: int = 0  # reference: 1 forbids EOS as the first generated token
    skip_special_tokens: bool = True
    seq_seed: int | None = None
    so_args: dict[str, Any] | None = None
    golden_token_ids: list[int] | None = None  # teacher forcing: emitted instead of sampled tokens

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if (
            isinstance(self.top_logprobs, bool)
            or not isinstance(self.top_logprobs, int)
            or self.top_logprobs < 0
        ):
            raise ValueError(f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}")
        if self.logprobs is False:  # the reference's boolean flag means "off"
            self.logprobs = None
        elif self.logprobs is True:
            self.logprobs = 0
        if self.top_logprobs and (self.logprobs is None or self.logprobs < self.top_logprobs):
            self.logprobs = self.top_logprobs
        validate_sampling_fields(self.temperature, self.top_p, self.top_k, self.min_p, self.logprobs)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if self.max_tokens == 0:  # reference semantics: 0 is silently turned into 1
            self.max_tokens = 1
        if not 1 <= self.max_tokens <= INT32_MAX:
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.first_n_token_no_eos not in (0, 1):
            raise ValueError(f"first_n_token_no_eos must be 0 or 1, got {self.first_n_token_no_eos!r}")
        if self.prompt_logprobs is False:
            self.prompt_logprobs = None
        elif self.prompt_logprobs is True:
            self.prompt_logprobs = 0
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None, a bool or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if self.seq_seed is not None:
            try:
                self.seq_seed = normalize_seed(self.seq_seed)
            except TypeError as e:
                raise ValueError(str(e)) from None
        if self.so_args is not None and not isinstance(self.so_args, dict):
            raise ValueError(f"so_args must be a dict or None, got {type(self.so_args).__name__}")
        if self.golden_token_ids is not None:
            self.golden_token_ids = [int(t) for t in self.golden_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
