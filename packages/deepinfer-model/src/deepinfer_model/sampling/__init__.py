"""Sampling: logits rows -> tokens, with per-row parameters and seeded, batch-independent streams."""

from .params import MAX_LOGPROBS, RowParams, normalize_seed, validate_sampling_fields
from .random_stream import DRAFT_SEED_OFFSET, Purpose, stream_bits, stream_uniform
from .sampler import Sampler, SamplerOutput
from .transform import filtered_probs

__all__ = [
    "DRAFT_SEED_OFFSET",
    "MAX_LOGPROBS",
    "Purpose",
    "RowParams",
    "Sampler",
    "SamplerOutput",
    "filtered_probs",
    "normalize_seed",
    "stream_bits",
    "stream_uniform",
    "validate_sampling_fields",
]
