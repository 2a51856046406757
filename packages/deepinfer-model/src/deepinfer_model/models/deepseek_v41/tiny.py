"""The architecture-complete tiny V4.1 config of spec v41-model §11 (every layer kind and feature once)."""

from __future__ import annotations

import copy

_TINY = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "quantization_config": {
        "quant_method": "fp8",
        "expert_dtype": "fp4",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
    },
    "vision_config": {"hidden_size": 64, "downsample_ratio": 2},
    "text_config": {
        "vocab_size": 256,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "num_nextn_predict_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 64,
        "o_lora_rank": 32,
        "o_groups": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "sliding_window": 8,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0],
        "index_topk": 8,
        "index_n_heads": 2,
        "index_head_dim": 128,
        "kv_source_layer_ids": [1, 3, 5],
        "index_k_source_layer_ids": [1, 3, 5],
        "index_source_layer_ids": [1, 2, 3, 5],
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 8,
        "candidate_block_size": 8,
        "use_fp4_sparse_kv": True,
        "hc_mult": 4,
        "hc_shifted": True,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "engram_layer_ids": [1],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 97,
        "engram_n_heads": 2,
        "engram_head_dim": 128,
        "engram_compressed_vocab_size": 200,
        "engram_pad_token_id": 2,
        "dspark_block_size": 4,
        "dspark_target_layer_ids": [3, 5],
        "dspark_target_attn_input": True,
        "dspark_markov_rank": 16,
        "dspark_noise_token_id": 3,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
}


# A small DeepSeek-ViT for tests: 2 blocks of width 64 (4 heads of 16), 2x2 merge (28-pixel cells), at most
# 48 language-model positions per image. Opt-in: deepinfer-tiny and the default model build on the §11
# config, and their checkpoints stay text-only.
_TINY_VISION_TOWER = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_image_tokens": 48,
}


def tiny_v41_config_dict(vision_tower: bool = False) -> dict:
    """A fresh (deep-copied) §11 `config.json` dict, safe to mutate in tests; `vision_tower=True` adds the
    small encoder to its `vision_config` (the checkpoint writer then writes `vision.*` / `aligner.*`)."""
    cfg = copy.deepcopy(_TINY)
    if vision_tower:
        cfg["vision_config"].update(_TINY_VISION_TOWER)
    return cfg
