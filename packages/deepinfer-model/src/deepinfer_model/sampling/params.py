"""Per-row sampling parameters and their validation.

The engine's `SamplingParams` validates through `validate_sampling_fields` so that the rules live
in one place and the error messages are the same wherever a bad value enters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Upper bound for the number of top logprobs one row may ask for (the reference allows 0 … 1000).
MAX_LOGPROBS = 1000
INT32_MAX = 2**31 - 1
UINT64_MASK = (1 << 64) - 1
# A positive temperature divides float32 logits: below 1e-5 (the reference's SAMPLING_EPS) the quotient
# can overflow (1e-300 even rounds to 0 in float32), above 1e5 the distribution is uniform to float32
# precision while the value may round to inf. Both ends are refused rather than clamped.
TEMPERATURE_RANGE = (1e-5, 1e5)
MIN_TEMPERATURE, MAX_TEMPERATURE = TEMPERATURE_RANGE
# OpenAI's (and vLLM's) ranges for the additive penalties and the logit bias.
ADDITIVE_PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# The repetition penalty divides or multiplies logits: bounded so that it can neither overflow a
# float32 logit of any plausible size nor flatten it to zero (vLLM asks only for > 0).
REPETITION_PENALTY_RANGE = (1e-2, 1e2)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x


def _in_range(x, bounds: tuple[float, float]) -> bool:
    return _is_number(x) and bounds[0] <= x <= bounds[1]


def validate_sampling_fields(
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    logprobs: int | None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
) -> None:
    """Raise a ValueError naming the first field that breaks its rule."""
    lo, hi = TEMPERATURE_RANGE
    if not (_is_number(temperature) and (temperature == 0 or lo <= temperature <= hi)):
        raise ValueError(f"temperature must be 0 (greedy) or in [{lo:g}, {hi:g}], got {temperature!r}")
    if not isinstance(top_p, int | float) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k == 0 or top_k < -1 or top_k > INT32_MAX:
        raise ValueError(f"top_k must be -1 (disabled) or an integer in [1, {INT32_MAX}], got {top_k!r}")
    if not isinstance(min_p, int | float) or not (0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not (0 <= logprobs <= MAX_LOGPROBS)
    ):
        raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _in_range(value, ADDITIVE_PENALTY_RANGE):
            raise ValueError(
                f"{name} must be in [{ADDITIVE_PENALTY_RANGE[0]:g}, {ADDITIVE_PENALTY_RANGE[1]:g}], got {value!r}"
            )
    if not _in_range(repetition_penalty, REPETITION_PENALTY_RANGE):
        lo, hi = REPETITION_PENALTY_RANGE
        raise ValueError(
            f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = off), got {repetition_penalty!r}"
        )


def validate_token_ids(name: str, ids, allow_empty: bool = True) -> tuple[int, ...]:
    """`ids` as a tuple of ints in [0, INT32_MAX]; ValueError naming `name` otherwise (bools refused)."""
    try:
        out = tuple(ids)
    except TypeError:
        raise ValueError(f"{name} must be a list of token ids, got {ids!r}") from None
    if not allow_empty and not out:
        raise ValueError(f"{name} must not be empty")
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX:
            raise ValueError(f"{name} must hold token ids in [0, {INT32_MAX}], got {t!r}")
    return out


def validate_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} mapping as sorted (id, float bias) pairs; ValueError naming logit_bias.
    Keys may be ints or decimal strings (JSON objects have string keys)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {type(bias).__name__}")
    lo, hi = LOGIT_BIAS_RANGE
    pairs = {}
    for key, value in bias.items():
        tid = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        validate_token_ids("logit_bias keys", [tid])
        if not _in_range(value, LOGIT_BIAS_RANGE):
            raise ValueError(f"logit_bias values must be in [{lo:g}, {hi:g}], got {value!r} for token {tid}")
        if tid in pairs:
            raise ValueError(f"logit_bias names token {tid} twice")
        pairs[tid] = float(value)
    return tuple(sorted(pairs.items()))


def normalize_seed(seed: int) -> int:
    """Seeds are 64-bit: any Python int (bools included) is taken modulo 2**64, like the reference."""
    if not isinstance(seed, int):
        raise TypeError(f"seq_seed must be an int or None, got {type(seed).__name__}")
    return int(seed) & UINT64_MASK


@dataclass(frozen=True)
class RowParams:
    """How one logits row is turned into a token.

    `seed` and `position` key the row's random stream (`deepinfer_spec.stream_uniform`): the draw depends on
    nothing else, so a request gives the same tokens whatever shares its batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int = 0
    position: int = 0
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token's logprob plus the top n
    banned_token_ids: tuple[int, ...] = field(default=())  # e.g. EOS before min_tokens
    # Logits processors (vLLM's), applied by `processors.process_logits_` in this order: allowed ids,
    # bad words, logit bias, then the penalties. The defaults leave the logits untouched.
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences: the last is banned after the rest
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added bias)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # The tokens seen before this row's position, read by the penalties (prompt + output) and bad
    # words (output); filled only when a penalty or a multi-token bad word needs them.
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
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
        object.__setattr__(self, "seed", normalize_seed(self.seed))
        if isinstance(self.position, bool) or not isinstance(self.position, int) or self.position < 0:
            raise ValueError(f"position must be an integer >= 0, got {self.position!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether a logits processor changes this row (False: the row is sampled from its logits)."""
        return bool(
            self.allowed_token_ids is not None
            or self.bad_words
            or self.logit_bias
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
