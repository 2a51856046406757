"""The public DeepSeek-V4 (`model_type: deepseek_v4`), stateless: one sequence, no cache.

Schedule (non-shifted mHC): every sub-layer computes its mixes from the trunk it receives, reads its
input with its own `pre`, and writes back with its own `post`/`comb`; an HC head collapses the trunk
before the final norm. Attention kinds per layer: sliding window only, CSA (ratio-4 overlapping
compression + lightning-indexer top-k) and HCA (large-ratio compression, dense over complete blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import SLIDING, AttentionSpec, ModelConfig, load_config
from ..layers import attention as attn
from ..layers import mhc
from ..layers.compressor import CompressorWeights, compress
from ..layers.embedding import embed
from ..layers.experts import ExpertWeights, MLPWeights
from ..layers.indexer import IndexerWeights, index_queries, index_scores, select_topk, selection_mask
from ..layers.moe import MoEWeights, moe_block
from ..layers.rope import cos_sin
from ..layout import model_tensors
from ..loader import load_tensors
from ..numerics import linear, mode, pinned, round_to
from ..ops.model_calls import hc_mixes, hc_read, hc_write, rms_norm


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attn_hc: mhc.HCParams
    ffn_hc: mhc.HCParams
    attn: attn.AttentionWeights
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None
    moe: MoEWeights


def _compressor_weights(t: dict[str, torch.Tensor], prefix: str) -> CompressorWeights:
    return CompressorWeights(
        wkv=t[prefix + ".wkv.weight"],
        wgate=t.get(prefix + ".wgate.weight"),
        norm=t[prefix + ".norm.weight"],
        ape=t.get(prefix + ".ape"),
    )


def layer_weights(cfg: ModelConfig, t: dict[str, torch.Tensor], layer: int) -> LayerWeights:
    """Group one layer's tensors (upstream names, already dequantised) into the block dataclasses."""
    p = f"layers.{layer}."
    spec = cfg.attention[layer]
    hc = {
        side: mhc.HCParams(t[f"{p}hc_{side}_fn"], t[f"{p}hc_{side}_base"], t[f"{p}hc_{side}_scale"])
        for side in ("attn", "ffn")
    }
    e = cfg.n_routed_experts
    experts = ExpertWeights(
        *(torch.stack([t[f"{p}ffn.experts.{x}.{n}.weight"] for x in range(e)]) for n in ("w1", "w3", "w2"))
    )
    shared = None
    if cfg.n_shared_experts:
        shared = MLPWeights(*(t[f"{p}ffn.shared_experts.{n}.weight"] for n in ("w1", "w3", "w2")))
    indexer = None
    if spec.has_indexer:
        indexer = IndexerWeights(
            wq_b=t[p + "attn.indexer.wq_b.weight"],
            weights_proj=t[p + "attn.indexer.weights_proj.weight"],
            compressor=_compressor_weights(t, p + "attn.indexer.compressor"),
        )
    return LayerWeights(
        attn_norm=t[p + "attn_norm.weight"],
        ffn_norm=t[p + "ffn_norm.weight"],
        attn_hc=hc["attn"],
        ffn_hc=hc["ffn"],
        attn=attn.AttentionWeights(
            wq_a=t[p + "attn.wq_a.weight"],
            q_norm=t[p + "attn.q_norm.weight"],
            wq_b=t[p + "attn.wq_b.weight"],
            wkv=t[p + "attn.wkv.weight"],
            kv_norm=t[p + "attn.kv_norm.weight"],
            wo_a=t[p + "attn.wo_a.weight"],
            wo_b=t[p + "attn.wo_b.weight"],
            sinks=t[p + "attn.attn_sink"],
        ),
        compressor=_compressor_weights(t, p + "attn.compressor") if spec.kind != SLIDING else None,
        indexer=indexer,
        moe=MoEWeights(
            gate=t[p + "ffn.gate.weight"],
            experts=experts,
            shared=shared,
            bias=t.get(p + "ffn.gate.bias"),
            tid2eid=t.get(p + "ffn.gate.tid2eid"),
        ),
    )


def v4_attention(
    y: torch.Tensor,
    positions: torch.Tensor,
    w: LayerWeights,
    spec: AttentionSpec,
    cfg: ModelConfig,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One public-V4 attention sub-layer over a whole sequence (`positions` = 0..T-1) -> [T, H]."""
    eps = cfg.rms_norm_eps
    cos, sin = cos_sin(spec.rope, positions)
    q, q_lat = attn.project_query(
        y, w.attn, cfg.num_attention_heads, cos, sin, eps, cfg.q_head_norm, act_dtype
    )
    keys = attn.project_latent(y, w.attn, cos, sin, eps, act_dtype)
    visible = attn.sliding_window_visible(positions, positions, cfg.sliding_window)
    if w.compressor is not None:
        r = spec.compress_ratio
        entries = compress(y, w.compressor, r, spec.overlap, spec.rope, eps, 0, act_dtype)
        n = entries.keys.shape[0]
        comp_visible = attn.compressed_visible(positions, n, r)
        if w.indexer is not None:
            index_keys = compress(y, w.indexer.compressor, r, spec.overlap, spec.rope, eps, 0, act_dtype).keys
            qi = index_queries(q_lat, w.indexer, cfg.index_n_heads, cos, sin, act_dtype)
            head_w = linear(y, w.indexer.weights_proj, act_dtype)
            scores = index_scores(qi, index_keys, head_w, cfg.index_score_scale, act_dtype)
            selected = select_topk(scores, comp_visible, cfg.index_topk)
            comp_visible = selection_mask(selected, n)
        keys = torch.cat((keys, entries.keys), dim=0)
        visible = torch.cat((visible, comp_visible), dim=1)
    o = attn.sink_attention(q, keys, visible, w.attn.sinks, cfg.head_dim**-0.5, act_dtype)
    return attn.project_output(round_to(o, act_dtype), w.attn, cfg.o_groups, cos, sin, act_dtype)


class DeepseekV4Model:
    """Stateless CPU reference of the public DeepSeek-V4. `forward(token_ids) -> logits [T, vocab]` (FP32)."""

    def __init__(
        self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        mode()  # a bad DEEPINFER_NUMERICS (or native + batch-invariant) fails at load, not at the first step
        self.config = cfg
        self.dtype = dtype
        self.embed = tensors["embed.weight"]
        self.head = tensors["head.weight"]
        self.norm = tensors["norm.weight"]
        self.hc_head = mhc.HCHeadParams(
            tensors["hc_head_fn"], tensors["hc_head_base"], tensors["hc_head_scale"]
        )
        self.layers = [layer_weights(cfg, tensors, i) for i in range(cfg.num_hidden_layers)]
        # moe_fn(layer, layer_weights, y, token_ids) -> [T, H]; e.g. deepinfer_model.parallel's
        # ExpertParallelMoE (experts sharded over EP ranks). Default: every expert in this process.
        self.moe_fn = self.local_moe

    @property
    def device(self) -> torch.device:
        """Where the weights are; every tensor of a forward is allocated there."""
        return self.embed.device

    def local_moe(self, layer: int, w: LayerWeights, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return moe_block(
            y, ids, w.moe, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit, self.dtype
        )

    @torch.inference_mode()
    @pinned  # the numerics settings read once per forward, not at every layer and op
    def forward(self, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
        cfg, act = self.config, self.dtype
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        x = round_to(embed(ids, self.embed), act)
        positions = torch.arange(ids.shape[0], device=ids.device)
        trunk = mhc.expand(x, cfg.hc_mult)
        hc_args = (cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters)
        for layer, (spec, w) in enumerate(zip(cfg.attention, self.layers)):
            pre, post, comb = hc_mixes(trunk, w.attn_hc, *hc_args)
            y = rms_norm(hc_read(trunk, pre, act), w.attn_norm, cfg.rms_norm_eps, act)
            trunk = hc_write(v4_attention(y, positions, w, spec, cfg, act), trunk, post, comb, act)
            pre, post, comb = hc_mixes(trunk, w.ffn_hc, *hc_args)
            y = rms_norm(hc_read(trunk, pre, act), w.ffn_norm, cfg.rms_norm_eps, act)
            h = self.moe_fn(layer, w, y, ids)
            trunk = hc_write(h, trunk, post, comb, act)
        weights = mhc.head_weights(trunk, self.hc_head, cfg.hc_eps, cfg.rms_norm_eps)
        hidden = rms_norm(hc_read(trunk, weights, act), self.norm, cfg.rms_norm_eps, act)
        return linear(hidden, self.head, torch.float32).float()

    __call__ = forward


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> DeepseekV4Model:
    """Load a public DeepSeek-V4 checkpoint directory (config.json + safetensors); the weights are
    dequantised on `device` and the model runs there."""
    from ..layers.expert_conversion import convert_experts_if_enabled
    from ..runtime.device import resolve_device

    cfg = load_config(path)
    tensors = load_tensors(path, cfg, model_tensors(cfg), dtype, device=resolve_device(device))
    model = DeepseekV4Model(cfg, tensors, dtype)
    if cfg.quant is not None and cfg.quant.expert_dtype == "fp4":
        # DEEPINFER_FP8_EXPERTS=1: MXFP4 routed experts as 128x128-block FP8 (FP8 checkpoints' experts
        # keep their own blocks and the default path)
        del tensors
        convert_experts_if_enabled(model.layers)
    return model
