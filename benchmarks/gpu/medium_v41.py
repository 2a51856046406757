"""The "medium" V4.1 config: the real V4.1 per-layer dimensions, few layers, tens of experts.

Per layer it matches the flagship: head dim 512 (448 latent + 64 RoPE), 64 query heads, one KV head,
indexer head dim 128, sliding window 128, compressed layers C2 / C1 with sparse top-512 selection and
candidate blocks. Hidden size 4096 and 16 routed experts of width 1024 keep the whole model small
enough to generate, load and check on one GPU within a device call; the layer topology (sharing,
Engram, DSpark) is the §11 tiny config's. The vocabulary is the real DeepSeek-V4 tokenizer's.

    from medium_v41 import medium_v41_config_dict
"""

from __future__ import annotations

from deepinfer_model.models.deepseek_v41.tiny import tiny_v41_config_dict

REAL_VOCAB = 129_280


def medium_v41_config_dict(
    hidden: int = 4096, experts: int = 16, expert_width: int = 1024, max_len: int = 65_536
) -> dict:
    cfg = tiny_v41_config_dict()
    t = cfg["text_config"]
    t.update(
        vocab_size=REAL_VOCAB,
        hidden_size=hidden,
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_lora_rank=1024,
        o_groups=8,
        max_position_embeddings=max_len,
        sliding_window=128,
        index_topk=512,
        index_n_heads=32,
        index_head_dim=128,
        candidate_topk_blocks=64,
        candidate_block_size=16,
        moe_intermediate_size=expert_width,
        n_routed_experts=experts,
        num_experts_per_tok=6,
        engram_vocab_size=100_003,
        engram_n_heads=4,
        engram_head_dim=128,
        engram_compressed_vocab_size=REAL_VOCAB,
        dspark_markov_rank=128,
        dspark_n_routed_experts=8,
        dspark_num_experts_per_tok=2,
    )
    t["rope_scaling"] = dict(t["rope_scaling"], factor=16.0, original_max_position_embeddings=max_len // 16)
    cfg["vision_config"] = {"hidden_size": 1024, "downsample_ratio": 2}
    return cfg
