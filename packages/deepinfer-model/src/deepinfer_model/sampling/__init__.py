"""Sampling: logits rows -> tokens, with per-row parameters and seeded, batch-independent streams.

The random stream is deepinfer-spec's, the one the speculative verifier draws from too, so a plain
decode and verification row 0 sample with the same uniforms by construction."""

from deepinfer_spec import DRAFT_SEED_OFFSET, Purpose, stream_bits, stream_uniform

from .bitmask import TokenBitmask, apply_token_bitmask_, disallowed_from_bitmask
from .params import (
    ADDITIVE_PENALTY_RANGE,
    LOGIT_BIAS_RANGE,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    TEMPERATURE_RANGE,
    RowParams,
    normalize_seed,
    validate_logit_bias,
    validate_sampling_fields,
    validate_token_ids,
)
from .processors import bad_word_bans, process_logits_
from .sampler import EMPTY_ROW_MESSAGE, Sampler, SamplerOutput, masked_logits
from .transform import filtered_probs

__all__ = [
    "ADDITIVE_PENALTY_RANGE",
    "DRAFT_SEED_OFFSET",
    "EMPTY_ROW_MESSAGE",
    "LOGIT_BIAS_RANGE",
    "MAX_LOGPROBS",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "Purpose",
    "REPETITION_PENALTY_RANGE",
    "RowParams",
    "Sampler",
    "SamplerOutput",
    "TEMPERATURE_RANGE",
    "TokenBitmask",
    "apply_token_bitmask_",
    "bad_word_bans",
    "disallowed_from_bitmask",
    "filtered_probs",
    "masked_logits",
    "normalize_seed",
    "process_logits_",
    "stream_bits",
    "stream_uniform",
    "validate_logit_bias",
    "validate_sampling_fields",
    "validate_token_ids",
]
