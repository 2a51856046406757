"""Sampling: logits rows -> tokens, with per-row parameters and seeded, batch-independent streams.

The random stream is deepinfer-spec's, the one the speculative verifier draws from too, so a plain
decode and verification row 0 sample with the same uniforms by construction.

The names below are imported from their modules on first use: `params` (the rules every entry point
validates with) is plain Python, and checking a request's parameters must not wait for torch."""

from __future__ import annotations

from deepinfer_cluster import lazy_exports

# module (as an import statement spells it, relative to this package) -> the public names it defines
_MODULES: dict[str, tuple[str, ...]] = {
    "deepinfer_spec": ("DRAFT_SEED_OFFSET", "Purpose", "stream_bits", "stream_uniform"),
    ".bitmask": ("TokenBitmask", "apply_token_bitmask_", "disallowed_from_bitmask"),
    ".params": (
        "ADDITIVE_PENALTY_RANGE",
        "LOGIT_BIAS_RANGE",
        "MAX_LOGPROBS",
        "MAX_TEMPERATURE",
        "MIN_TEMPERATURE",
        "REPETITION_PENALTY_RANGE",
        "TEMPERATURE_RANGE",
        "RowParams",
        "normalize_seed",
        "validate_logit_bias",
        "validate_sampling_fields",
        "validate_token_ids",
    ),
    ".processors": ("bad_word_bans", "process_logits_"),
    ".sampler": ("EMPTY_ROW_MESSAGE", "Sampler", "SamplerOutput", "masked_logits"),
    ".transform": ("filter_probs", "filter_values", "filtered_probs"),
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, globals(), _MODULES)
