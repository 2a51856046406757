"""Sampling: logits rows -> tokens, with per-row parameters and seeded, batch-independent streams.

The random stream is deepinfer-spec's, the one the speculative verifier draws from too, so a plain
decode and verification row 0 sample with the same uniforms by construction."""

from deepinfer_spec import DRAFT_SEED_OFFSET, Purpose, stream_bits, stream_uniform

from .bitmask import TokenBitmask, apply_token_bitmask_, disallowed_from_bitmask
from .params import (
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    RowParams,
    normalize_seed,
    validate_sampling_fields,
)
from .sampler import EMPTY_ROW_MESSAGE, Sampler, SamplerOutput, masked_logits
from .transform import filtered_probs

__all__ = [
    "DRAFT_SEED_OFFSET",
    "EMPTY_ROW_MESSAGE",
    "MAX_LOGPROBS",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "Purpose",
    "RowParams",
    "Sampler",
    "SamplerOutput",
    "TokenBitmask",
    "apply_token_bitmask_",
    "disallowed_from_bitmask",
    "filtered_probs",
    "masked_logits",
    "normalize_seed",
    "stream_bits",
    "stream_uniform",
    "validate_sampling_fields",
]
