"""deepinfer-model: the DeepSeek-V4 family (public V4 and V4.1) for DeepInfer.

Other packages import what they need from here; `testing` (tiny checkpoints and sequences for tests)
is the one submodule they may import directly.
"""

from __future__ import annotations

from deepinfer_cluster import lazy_exports

# module (as an import statement spells it, relative to this package) -> the public names it defines.
# Each is imported on first use: the engine's parameter checks (`validate_sampling_fields`) need no torch.
_MODULES: dict[str, tuple[str, ...]] = {
    ".config": ("ConfigError", "ModelConfig", "load_config", "parse_config"),
    ".loader": ("CheckpointError",),
    ".models": ("check_checkpoint_context_parallel", "load_model"),
    ".models.deepseek_v4": ("DeepseekV4Model",),
    ".models.deepseek_v41": (
        "DeepseekV41Config",
        "DeepseekV41ForCausalLM",
        "DraftOutput",
        "V41Output",
        "load_v41",
        "make_v41_checkpoint",
        "tiny_v41_config_dict",
    ),
    ".models.deepseek_v41.vision": (
        "EncoderCache",
        "ImageError",
        "ImagePreprocessor",
        "ImageSentinels",
        "compression_stride",
        "expand_images",
        "image_digest",
        "image_grid_of",
        "parse_vision_config",
    ),
    ".models.deepseek_v41.yoco": (
        "YocoSettings",
        "check_prompt_logprobs",
        "check_settings",
        "max_backtracking",
        "prefill_flops",
    ),
    ".parallel": ("ExpertParallelMoE", "load_v41_ep", "shard_experts"),
    ".quant_sm90": ("refuse_with_expert_parallelism",),
    ".runner": ("StepBatch",),
    ".runtime": (
        "BlockPayload",
        "DraftSampling",
        "PayloadError",
        "cache_layout",
        "cache_specs",
        "decode_graph_settings",
        "export_request",
        "make_runner",
    ),
    ".runtime.device": ("model_device", "resolve_device", "to_device"),
    ".sampling": (
        "EMPTY_ROW_MESSAGE",
        "Sampler",
        "SamplerOutput",
        "TokenBitmask",
        "filtered_probs",
        "masked_logits",
        "process_logits_",
    ),
    ".sampling.params": (
        "MAX_LOGPROBS",
        "MAX_TEMPERATURE",
        "MIN_TEMPERATURE",
        "RowParams",
        "normalize_seed",
        "validate_logit_bias",
        "validate_sampling_fields",
        "validate_token_ids",
    ),
    ".tokenizer_files": ("DEFAULT_CHAT_TEMPLATE", "EARLIER_DEFAULT_CHAT_TEMPLATES", "write_tokenizer"),
}

__version__ = "0.1.0"

__public_modules__ = ("testing", "training")

__getattr__, __dir__, __all__ = lazy_exports(__name__, globals(), _MODULES)
