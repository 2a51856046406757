"""The V4.1 HF checkpoint layout (spec v41-model §9.3): every tensor's name, shape and storage kind.

Kinds are the shared loader's (`deepinfer_model.layout`): `float` (BF16), `f32`, `fp8` (E4M3 weight +
`.scale` F8_E8M0 per 32x32 block) and `expert` (MXFP4 routed expert: int8 with two E2M1 codes per byte
+ `.scale` F8_E8M0 per 1x32 block). The same table drives the checkpoint writer and the loader.
"""

from __future__ import annotations

from ...layout import TensorSpec
from .config import DeepseekV41Config
from .engram_hash import EngramLayout
from .vision.layout import vision_layout

BF16, F32, FP8, FP4 = "float", "f32", "fp8", "expert"
FP8_ROWS = "fp8_rows"  # FP8 with one UE8M0 scale per row and 32 columns (Engram tables)


def _block(prefix: str, cfg: DeepseekV41Config, layer: int | None, n_experts: int) -> list[TensorSpec]:
    """Tensors of one decoder block (`layer` = backbone layer id, None for a draft block)."""
    H, m, D, nh = cfg.hidden_size, cfg.hc_mult, cfg.head_dim, cfg.num_attention_heads
    G, Ro, Rq, Im = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank, cfg.moe_intermediate_size
    n_mix = (2 + m) * m
    s = [
        TensorSpec(f"{prefix}attn_norm.weight", (H,), BF16),
        TensorSpec(f"{prefix}ffn_norm.weight", (H,), BF16),
    ]
    for side in ("attn", "ffn"):
        s += [
            TensorSpec(f"{prefix}hc_{side}_fn", (n_mix, m * H), F32),
            TensorSpec(f"{prefix}hc_{side}_base", (n_mix,), F32),
            TensorSpec(f"{prefix}hc_{side}_scale", (3,), F32),
        ]
    a = prefix + "attn."
    s += [
        TensorSpec(a + "wq_a.weight", (Rq, H), FP8),
        TensorSpec(a + "q_norm.weight", (Rq,), BF16),
        TensorSpec(a + "wq_b.weight", (nh * D, Rq), FP8),
        TensorSpec(a + "wkv.weight", (D, H), FP8),
        TensorSpec(a + "kv_norm.weight", (D,), BF16),
        TensorSpec(a + "wo_a.weight", (G * Ro, nh // G * D), FP8),
        TensorSpec(a + "wo_b.weight", (H, G * Ro), FP8),
        TensorSpec(a + "attn_sink", (nh,), F32),
    ]
    topo = cfg.topology
    if layer is not None and cfg.compress_ratios[layer] > 0:
        if topo.is_kv_source(layer):
            s.append(TensorSpec(a + "compressor.wkv.weight", (D, H), BF16))
            if cfg.compress_ratios[layer] == 2:
                s.append(TensorSpec(a + "compressor.wgate.weight", (D, H), BF16))
            s.append(TensorSpec(a + "compressor.norm.weight", (D,), BF16))
        if topo.is_index_source(layer):
            ni, di = cfg.index_n_heads, cfg.index_head_dim
            s += [
                TensorSpec(a + "indexer.wq_b.weight", (ni * di, Rq), FP8),
                TensorSpec(a + "indexer.weights_proj.weight", (ni, H), BF16),
            ]
            if topo.is_index_k_source(layer):
                s += [
                    TensorSpec(a + "indexer.wk.weight", (di, D), BF16),
                    TensorSpec(a + "indexer.k_norm.weight", (di,), BF16),
                ]
    f = prefix + "ffn."
    Is = cfg.n_shared_experts * Im
    s += [
        TensorSpec(f + "gate.weight", (n_experts, H), BF16),
        TensorSpec(f + "gate.bias", (n_experts,), F32),
        TensorSpec(f + "gate.bias_vl", (n_experts,), F32),
        TensorSpec(f + "shared_experts.w1.weight", (Is, H), FP8),
        TensorSpec(f + "shared_experts.w3.weight", (Is, H), FP8),
        TensorSpec(f + "shared_experts.w2.weight", (H, Is), FP8),
    ]
    for e in range(n_experts):
        s += [
            TensorSpec(f"{f}experts.{e}.w1.weight", (Im, H), FP4),
            TensorSpec(f"{f}experts.{e}.w3.weight", (Im, H), FP4),
            TensorSpec(f"{f}experts.{e}.w2.weight", (H, Im), FP4),
        ]
    if layer is not None and cfg.engram and layer in cfg.engram.layer_ids:
        eg = cfg.engram
        rows = EngramLayout.from_config(eg).table_rows(layer)
        width = (eg.max_ngram_size - 1) * eg.n_heads * eg.head_dim
        s += [
            TensorSpec(prefix + "engram.embed.weight", (rows, eg.head_dim), FP8_ROWS),
            TensorSpec(prefix + "engram.wkv.weight", ((m + 1) * H, width), FP8),
            TensorSpec(prefix + "engram.q_weight", (m, H), BF16),
            TensorSpec(prefix + "engram.k_weight", (m, H), BF16),
        ]
    return s


def checkpoint_layout(cfg: DeepseekV41Config) -> dict[str, TensorSpec]:
    """Every tensor a V4.1 checkpoint must contain, by name, in a stable order; the vision tower's come last
    and only when the config describes one (so a text-only layout, and its random draws, stay as they are)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    specs = [
        TensorSpec("embed.weight", (V, H), BF16),
        TensorSpec("head.weight", (V, H), BF16),
        TensorSpec("norm.weight", (H,), BF16),
        TensorSpec("image_start", (H,), BF16),
        TensorSpec("image_end", (H,), BF16),
        TensorSpec("image_newline", (H,), BF16),
    ]
    for layer in range(cfg.num_hidden_layers):
        specs += _block(f"layers.{layer}.", cfg, layer, cfg.n_routed_experts)
    ds = cfg.dspark
    if ds:
        n_t = len(ds.target_layer_ids)
        specs += [
            TensorSpec("mtp.0.main_proj.weight", (H, n_t * H), FP8),
            TensorSpec("mtp.0.main_norm.weight", (H,), BF16),
        ]
        for i in range(ds.num_blocks):
            specs += _block(f"mtp.{i}.", cfg, None, ds.n_routed_experts)
        last = f"mtp.{ds.num_blocks - 1}."
        specs += [
            TensorSpec(last + "norm.weight", (H,), BF16),
            TensorSpec(last + "markov_head.embed.weight", (V, ds.markov_rank), BF16),
            TensorSpec(last + "markov_head.head.weight", (V, ds.markov_rank), BF16),
            TensorSpec(last + "confidence_head.proj.weight", (1, H + ds.markov_rank), BF16),
        ]
    if cfg.vision:
        specs += vision_layout(cfg.vision, H)
    return {s.name: s for s in specs}
