"""deepinfer-spec: DSpark draft bookkeeping, verification, confidence-scheduled verification, accounting."""

from .coupled import SAMPLED_VERIFY_MODES, coupled_agreement, draft_stream_seed
from .draft_policy import AcceptanceCalibration, DraftPlan, DraftPolicy, LinearCost
from .env import (
    DEFAULT_NEXTN,
    MAX_NEXTN,
    nextn_from_env,
    probe_budget_from_env,
    sampled_verify_from_env,
    varlen_from_env,
)
from .random_stream import (
    DRAFT_SEED_OFFSET,
    VERIFY_ROW_STRIDE,
    Purpose,
    draft_position,
    int64_bits,
    stream_bits,
    stream_uniform,
    stream_uniforms,
    stream_uniforms_tensor,
    verify_row_position,
)
from .row_blocks import cat_rows
from .state import Rollback, SpecDecodeState, cumulative_rates
from .stats import SpecStats, expected_calibration_error, full_acceptance_tokens_per_s
from .step_time import ForwardRuntimeEstimator, SamplerRuntimeEstimator, StepTimeCurve
from .varlen import ConfidenceScheduler, VarlenRequest, VerifyPlan, split_by_rates, split_by_rates_tensor
from .verify import DraftVerifier, VerifyResult, inverse_cdf

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_NEXTN",
    "DRAFT_SEED_OFFSET",
    "MAX_NEXTN",
    "SAMPLED_VERIFY_MODES",
    "VERIFY_ROW_STRIDE",
    "AcceptanceCalibration",
    "ConfidenceScheduler",
    "DraftPlan",
    "DraftPolicy",
    "DraftVerifier",
    "ForwardRuntimeEstimator",
    "LinearCost",
    "Purpose",
    "Rollback",
    "SamplerRuntimeEstimator",
    "SpecDecodeState",
    "SpecStats",
    "StepTimeCurve",
    "VarlenRequest",
    "VerifyPlan",
    "VerifyResult",
    "cat_rows",
    "coupled_agreement",
    "cumulative_rates",
    "draft_position",
    "draft_stream_seed",
    "expected_calibration_error",
    "full_acceptance_tokens_per_s",
    "int64_bits",
    "inverse_cdf",
    "nextn_from_env",
    "probe_budget_from_env",
    "sampled_verify_from_env",
    "split_by_rates",
    "split_by_rates_tensor",
    "stream_bits",
    "stream_uniform",
    "stream_uniforms",
    "stream_uniforms_tensor",
    "varlen_from_env",
    "verify_row_position",
]
