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
# The sampler divides float32 logits by the temperature: below MIN the quotient of ordinary logits
# overflows float32 (and a colder draw is the argmax anyway: use 0), above MAX the temperature itself
# leaves float32's comfortable range. Both bounds keep T and 1/T far from float32's limits.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6


def validate_sampling_fields(
    temperature: float, top_p: float, top_k: int, min_p: float, logprobs: int | None
) -> None:
    """Raise a ValueError naming the first field that breaks its rule."""
    if not isinstance(temperature, int | float) or not (
        temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE
    ):
        raise ValueError(
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {temperature!r}"
        )
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

    def __post_init__(self) -> None:
        validate_sampling_fields(self.temperature, self.top_p, self.top_k, self.min_p, self.logprobs)
        object.__setattr__(self, "seed", normalize_seed(self.seed))
        if isinstance(self.position, bool) or not isinstance(self.position, int) or self.position < 0:
            raise ValueError(f"position must be an integer >= 0, got {self.position!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
