"""deepinfer-model: the DeepSeek-V4 family (public V4 and V4.1) for DeepInfer.

Other packages import what they need from here; `testing` (tiny checkpoints and sequences for tests)
is the one submodule they may import directly.
"""

from .config import ConfigError, ModelConfig, load_config, parse_config
from .loader import CheckpointError
from .models import load_model
from .models.deepseek_v4 import DeepseekV4Model
from .models.deepseek_v41 import (
    DeepseekV41Config,
    DeepseekV41ForCausalLM,
    DraftOutput,
    V41Output,
    load_v41,
    make_v41_checkpoint,
    tiny_v41_config_dict,
)
from .models.deepseek_v41.yoco import (
    YocoSettings,
    check_prompt_logprobs,
    check_settings,
    max_backtracking,
    prefill_flops,
)
from .parallel import ExpertParallelMoE, load_v41_ep, shard_experts
from .quant_sm90 import refuse_with_expert_parallelism
from .runner import StepBatch
from .runtime import (
    BlockPayload,
    PayloadError,
    cache_layout,
    cache_specs,
    decode_graph_settings,
    export_request,
    make_runner,
)
from .runtime.device import model_device, resolve_device, to_device
from .sampling import (
    EMPTY_ROW_MESSAGE,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    RowParams,
    Sampler,
    SamplerOutput,
    TokenBitmask,
    filtered_probs,
    masked_logits,
    normalize_seed,
    process_logits_,
    validate_logit_bias,
    validate_sampling_fields,
    validate_token_ids,
)
from .tokenizer_files import DEFAULT_CHAT_TEMPLATE, EARLIER_DEFAULT_CHAT_TEMPLATES, write_tokenizer

__version__ = "0.1.0"

__public_modules__ = ("testing", "training")

__all__ = [
    "BlockPayload",
    "PayloadError",
    "export_request",
    "cache_layout",
    "DEFAULT_CHAT_TEMPLATE",
    "EARLIER_DEFAULT_CHAT_TEMPLATES",
    "MAX_LOGPROBS",
    "CheckpointError",
    "ConfigError",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "DeepseekV4Model",
    "DraftOutput",
    "EMPTY_ROW_MESSAGE",
    "ExpertParallelMoE",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "ModelConfig",
    "RowParams",
    "Sampler",
    "SamplerOutput",
    "StepBatch",
    "TokenBitmask",
    "V41Output",
    "YocoSettings",
    "check_prompt_logprobs",
    "check_settings",
    "decode_graph_settings",
    "filtered_probs",
    "load_config",
    "load_model",
    "load_v41",
    "load_v41_ep",
    "cache_specs",
    "make_runner",
    "make_v41_checkpoint",
    "write_tokenizer",
    "masked_logits",
    "max_backtracking",
    "model_device",
    "normalize_seed",
    "parse_config",
    "prefill_flops",
    "process_logits_",
    "refuse_with_expert_parallelism",
    "resolve_device",
    "shard_experts",
    "tiny_v41_config_dict",
    "to_device",
    "validate_logit_bias",
    "validate_sampling_fields",
    "validate_token_ids",
]
