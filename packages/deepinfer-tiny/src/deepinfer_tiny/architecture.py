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

from deepinfer_model import tiny_v41_config_dict

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

# What differs from the architecture-complete tiny config of spec v41-model §11 (the test checkpoints'):
# the real vocabulary, a 4,096-token context, two more compressed layers, and sizes that hold information.
_TINY_TEXT = {
    **_TOPOLOGY,
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "max_position_embeddings": 4096,
    "sliding_window": 128,
    "index_topk": 128,
    "index_n_heads": 4,
    "candidate_topk_blocks": 32,
    "candidate_block_size": 16,
    "moe_intermediate_size": 128,
    "n_routed_experts": 16,
    "engram_vocab_size": 4099,
    "engram_head_dim": 64,
    "engram_compressed_vocab_size": 129280,
    "dspark_block_size": 5,
    "dspark_markov_rank": 8,
}
# The §11 config's YaRN scaling stretches its 64-token original context; this model trains at its full one.
_DROPPED_TEXT = ("rope_scaling",)

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
    cfg = tiny_v41_config_dict()
    text = cfg["text_config"]
    for key in _DROPPED_TEXT:
        text.pop(key, None)
    text.update(copy.deepcopy(_TINY_TEXT))
    return cfg


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
