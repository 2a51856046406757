"""The deepinfer-tiny architecture: a V4.1 `config.json` that uses every layer kind, sized for 48 MiB.

Layer plan (8 backbone layers, 2 DSpark draft blocks):

| layer | ratio | role |
| --- | --- | --- |
| 0 | 0 | SWA only |
| 1 | 2 | C2: KV / index-K / index source, Engram |
| 2 | 2 | C2: KV and index-K consumer of 1, own indexer |
| 3 | 2 | C2: KV / index-K / index source |
| 4 | 1 | C1: first YOCO consumer (S), KV / index-K / index source, candidate source |
| 5 | 1 | C1: KV consumer of 4, reuses 4's top-k, drafter target |
| 6 | 1 | C1: KV source fed from S, indexer restricted to 4's candidate blocks |
| 7 | 1 | C1: KV consumer of 6, reuses 6's top-k, drafter target |

The real DeepSeek-V4 vocabulary (129,280 entries) makes the BF16 embedding and LM head (`[V, H]` each,
never quantised in the V4.1 layout) the bulk of the bytes: H = 64 keeps them at 16.5 MB each, the
largest that fits 48 MiB together with the tokenizer, the Markov head (`[V, rank]` x 2, BF16) and the
FP8 / FP4 layers. `checkpoint_bytes` counts the stored bytes of any config.
"""

from __future__ import annotations

import copy
import math

# The sharing pattern (kv / index-K / index sources, candidate source, targets) is spelled out once here
# and reused by the micro config of the tests, so both exercise the same topology.
_TOPOLOGY = {
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0, 0],
    "kv_source_layer_ids": [1, 3, 4, 6],
    "index_k_source_layer_ids": [1, 3, 4, 6],
    "index_source_layer_ids": [1, 2, 3, 4, 6],
    "candidate_source_layer_id": 4,
    "engram_layer_ids": [1],
    "dspark_target_layer_ids": [5, 7],
}

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
        "vocab_size": 129280,
        "hidden_size": 64,
        "num_hidden_layers": 8,
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
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "sliding_window": 128,
        **_TOPOLOGY,
        "index_topk": 128,
        "index_n_heads": 4,
        "index_head_dim": 128,
        "candidate_topk_blocks": 32,
        "candidate_block_size": 16,
        "use_fp4_sparse_kv": True,
        "hc_mult": 4,
        "hc_shifted": True,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "moe_intermediate_size": 128,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 4099,
        "engram_n_heads": 2,
        "engram_head_dim": 64,
        "engram_compressed_vocab_size": 129280,
        "engram_pad_token_id": 2,
        "dspark_block_size": 5,
        "dspark_target_attn_input": True,
        "dspark_markov_rank": 8,
        "dspark_noise_token_id": 3,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
}

# Test-sized dims on the same topology: the CPU verification runs in seconds.
_MICRO_TEXT = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "o_lora_rank": 32,
    "q_lora_rank": 32,
    "max_position_embeddings": 256,
    "sliding_window": 8,
    "index_topk": 8,
    "index_n_heads": 2,
    "candidate_topk_blocks": 8,
    "candidate_block_size": 8,
    "hc_sinkhorn_iters": 4,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "engram_vocab_size": 97,
    "engram_head_dim": 32,
    "dspark_markov_rank": 4,
    "dspark_n_routed_experts": 2,
}


def tiny_config_dict() -> dict:
    """deepinfer-tiny's `config.json` (a fresh copy)."""
    return copy.deepcopy(_TINY)


def micro_config_dict() -> dict:
    """The same topology with test-sized dims (real vocabulary, so the real tokenizer applies)."""
    cfg = tiny_config_dict()
    cfg["text_config"].update(_MICRO_TEXT)
    return cfg


# Bytes per element of each storage kind of `deepinfer_model`'s V4.1 layout (without the scales).
_ELEMENT_BYTES = {"float": 2.0, "f32": 4.0, "fp8": 1.0, "fp8_rows": 1.0, "expert": 0.5}


def checkpoint_bytes(config: dict) -> dict[str, int]:
    """Stored bytes (weights and their UE8M0 scales) per top-level group: `embed`, `head`, `layers`, `mtp`,
    `other`, plus `total` and `params` (logical parameter count)."""
    from deepinfer_model.training import DeepseekV41Config, checkpoint_layout

    cfg = DeepseekV41Config.from_dict(config)
    block = tuple(cfg.quant.weight_block_size)
    out = {"embed": 0, "head": 0, "layers": 0, "mtp": 0, "other": 0, "params": 0}
    for spec in checkpoint_layout(cfg).values():
        rows, cols = (spec.shape + (1,))[:2] if len(spec.shape) == 1 else spec.shape
        n = math.prod(spec.shape)
        size = int(n * _ELEMENT_BYTES[spec.kind])
        if spec.kind == "fp8":
            size += math.ceil(rows / block[0]) * math.ceil(cols / block[1])
        elif spec.kind in ("fp8_rows", "expert"):
            size += rows * math.ceil(cols / 32)
        head = spec.name.split(".")[0]
        out[head if head in out else "other"] += size
        out["params"] += n
    out["total"] = sum(v for k, v in out.items() if k != "params")
    return out
