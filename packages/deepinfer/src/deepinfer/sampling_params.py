"""`SamplingParams`: how each request is decoded (the reference's fields plus what vLLM users expect)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer_model import (
    MAX_LOGPROBS,
    normalize_seed,
    validate_logit_bias,
    validate_sampling_fields,
    validate_token_ids,
)

INT32_MAX = 2**31 - 1


@dataclass
class SamplingParams:
    """Per-request decoding parameters. Invalid values raise a `ValueError` naming the field.

    temperature 0 means greedy (argmax, lowest id on ties). Transform order: temperature, top-p,
    top-k (reference order), then min-p. With `seq_seed` set, each token's draw is a pure function of
    (seq_seed, position), so the output does not depend on what else runs in the batch; sample i of
    `n` uses seed `seq_seed + i`. Without it the engine derives a seed from its own seeded generator.
    `seed` is vLLM's name for `seq_seed` (give either, or both equal).

    vLLM's logits processors run before the temperature, in this order: `allowed_token_ids`,
    `bad_words`, `logit_bias`, then `repetition_penalty` (over prompt + output), `frequency_penalty`
    and `presence_penalty` (over the output). Each depends only on the tokens the sequence has seen,
    so they keep the guarantees above. Ranges and defaults: the engine README's table.
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
    seed: int | None = None  # vLLM's name for seq_seed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (tokenized by the engine)

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
        validate_sampling_fields(
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.logprobs,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
        )
        # vLLM refuses 0 (the reference turned it into 1, which generated a token nobody asked for)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
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
        self._check_seed()
        self._check_processors()
        if self.so_args is not None and not isinstance(self.so_args, dict):
            raise ValueError(f"so_args must be a dict or None, got {type(self.so_args).__name__}")
        if self.golden_token_ids is not None:
            self.golden_token_ids = [int(t) for t in self.golden_token_ids]

    def _check_seed(self) -> None:
        """seq_seed and its vLLM alias seed: normalised to 64 bits, and equal when both are given."""
        seeds = {}
        for name in ("seq_seed", "seed"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, int):  # (a bool is an int here, as in the reference)
                    raise ValueError(f"{name} must be an int or None, got {type(value).__name__}")
                seeds[name] = normalize_seed(value)
        if len(set(seeds.values())) > 1:
            raise ValueError(
                f"seed is an alias of seq_seed: give one, or both equal (got seq_seed={self.seq_seed!r}, "
                f"seed={self.seed!r})"
            )
        if seeds:
            self.seq_seed = self.seed = next(iter(seeds.values()))

    def _check_processors(self) -> None:
        if self.logit_bias is not None:
            self.logit_bias = dict(validate_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(
                validate_token_ids("allowed_token_ids", self.allowed_token_ids, allow_empty=False)
            )
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            self.bad_words = list(self.bad_words)
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reads_seen_tokens(self) -> bool:
        """Whether sampling depends on the tokens seen so far (penalties; bad words of several tokens
        are decided by the engine once they are tokenized)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


def validate_vocab_fields(params: SamplingParams, vocab_size: int) -> None:
    """The token ids `params` carries for the logits processors, checked against the model's
    vocabulary (ValueError naming the field); the engine calls it before admitting a request."""
    for name, ids in (
        ("logit_bias", list(params.logit_bias or ())),
        ("allowed_token_ids", params.allowed_token_ids or []),
    ):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"{name} must hold token ids in [0, {vocab_size}) (the model's vocabulary), got {bad[:5]}"
            )
