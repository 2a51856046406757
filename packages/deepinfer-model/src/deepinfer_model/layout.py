"""The tensors a DeepSeek-V4 checkpoint must hold (upstream names), derived from the config.

Shared by the loader (what to expect) and the checkpoint writer (what to write). Shapes are the
logical (dequantised) shapes; `kind` says how a tensor may be stored:

* `float`  - BF16 / F16 / F32, never quantised (norms, embeddings, gate, compressor, ...)
* `f32`    - must be F32 (hyper-connection mixes, attention sinks, gate bias, position bias)
* `index`  - I32 / I64 (hash-routing table)
* `fp8`    - float, or F8_E4M3 + `.scale` (block-scaled) in a quantised checkpoint
* `expert` - like `fp8`, or MXFP4 (packed I8 + `.scale`) when `expert_dtype == "fp4"`
* `fp8_rows` - like `fp8` but scaled per row in 1 x 32 groups (V4.1 Engram tables)
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import HASH_MOE, SLIDING, ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str


def _compressor(prefix: str, ratio: int, width: int, overlap: bool, bias: bool) -> list[TensorSpec]:
    w = 2 * width if overlap else width
    specs = [
        TensorSpec(f"{prefix}.wkv.weight", (w, 0), "float"),
        TensorSpec(f"{prefix}.norm.weight", (width,), "float"),
    ]
    if ratio > 1:
        specs.append(TensorSpec(f"{prefix}.wgate.weight", (w, 0), "float"))
    if bias:
        specs.append(TensorSpec(f"{prefix}.ape", (ratio, w), "f32"))
    return specs


def layer_tensors(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """Every tensor of backbone layer `layer` (prefix `layers.{layer}.`)."""
    h, m, d = cfg.hidden_size, cfg.hc_mult, cfg.head_dim
    nh, rq, g, ro = cfg.num_attention_heads, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    e, i, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    is_ = cfg.n_shared_experts * i
    mix = (2 + m) * m
    p = f"layers.{layer}."
    specs = [
        TensorSpec(p + "attn_norm.weight", (h,), "float"),
        TensorSpec(p + "ffn_norm.weight", (h,), "float"),
    ]
    for side in ("attn", "ffn"):
        specs += [
            TensorSpec(f"{p}hc_{side}_fn", (mix, m * h), "f32"),
            TensorSpec(f"{p}hc_{side}_base", (mix,), "f32"),
            TensorSpec(f"{p}hc_{side}_scale", (3,), "f32"),
        ]
    specs += [
        TensorSpec(p + "attn.wq_a.weight", (rq, h), "fp8"),
        TensorSpec(p + "attn.q_norm.weight", (rq,), "float"),
        TensorSpec(p + "attn.wq_b.weight", (nh * d, rq), "fp8"),
        TensorSpec(p + "attn.wkv.weight", (d, h), "fp8"),
        TensorSpec(p + "attn.kv_norm.weight", (d,), "float"),
        TensorSpec(p + "attn.wo_a.weight", (g * ro, nh * d // g), "fp8"),
        TensorSpec(p + "attn.wo_b.weight", (h, g * ro), "fp8"),
        TensorSpec(p + "attn.attn_sink", (nh,), "f32"),
    ]
    spec = cfg.attention[layer]
    if spec.kind != SLIDING:
        specs += _compressor(p + "attn.compressor", spec.compress_ratio, d, spec.overlap, spec.position_bias)
    if spec.has_indexer:
        ni, di = cfg.index_n_heads, cfg.index_head_dim
        specs += [
            TensorSpec(p + "attn.indexer.wq_b.weight", (ni * di, rq), "fp8"),
            TensorSpec(p + "attn.indexer.weights_proj.weight", (ni, h), "float"),
        ]
        specs += _compressor(
            p + "attn.indexer.compressor", spec.compress_ratio, di, spec.overlap, spec.position_bias
        )
    specs.append(TensorSpec(p + "ffn.gate.weight", (e, h), "float"))
    if cfg.mlp_layer_types[layer] == HASH_MOE:
        specs.append(TensorSpec(p + "ffn.gate.tid2eid", (cfg.vocab_size, k), "index"))
    else:
        specs.append(TensorSpec(p + "ffn.gate.bias", (e,), "f32"))
    for x in range(e):
        specs += [
            TensorSpec(f"{p}ffn.experts.{x}.w1.weight", (i, h), "expert"),
            TensorSpec(f"{p}ffn.experts.{x}.w3.weight", (i, h), "expert"),
            TensorSpec(f"{p}ffn.experts.{x}.w2.weight", (h, i), "expert"),
        ]
    if is_:
        specs += [
            TensorSpec(p + "ffn.shared_experts.w1.weight", (is_, h), "fp8"),
            TensorSpec(p + "ffn.shared_experts.w3.weight", (is_, h), "fp8"),
            TensorSpec(p + "ffn.shared_experts.w2.weight", (h, is_), "fp8"),
        ]
    # compressor projections read the hidden: fill in the input width left as 0 above
    return [TensorSpec(s.name, (s.shape[0], h), s.kind) if s.shape[-1:] == (0,) else s for s in specs]


def model_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """All tensors of a public DeepSeek-V4 checkpoint, by upstream name (MTP blocks are not read)."""
    h, m, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    specs = [
        TensorSpec("embed.weight", (v, h), "float"),
        TensorSpec("head.weight", (v, h), "float"),
        TensorSpec("norm.weight", (h,), "float"),
    ]
    if not cfg.hc_shifted:
        specs += [
            TensorSpec("hc_head_fn", (m, m * h), "f32"),
            TensorSpec("hc_head_base", (m,), "f32"),
            TensorSpec("hc_head_scale", (1,), "f32"),
        ]
    for layer in range(cfg.num_hidden_layers):
        specs += layer_tensors(cfg, layer)
    return {s.name: s for s in specs}
