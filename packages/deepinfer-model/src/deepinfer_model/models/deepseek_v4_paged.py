"""The public DeepSeek-V4 run incrementally over a packed batch with paged caches.

Everything except attention is per token, so those blocks run once over the packed tokens of all
sequences. Attention writes each token's sliding-window latent and compressor input to the paged
pools, extends the compressed (and index) entries of blocks that complete in this step, and lets
every query attend to the keys the stateless forward would make visible to it: its window, plus all
compressed entries (HCA) or the indexer's top-k of them (CSA).

Cache per layer (spec v41-model §4.9 for the public model): `swa.L` one latent per token; for
compressed layers `hidden.L` (compressor input of every token: the state of incomplete blocks),
`comp.L` one key per entry; for CSA `index_k.L` one index key per entry.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import SLIDING, AttentionSpec, ModelConfig
from ..layers import attention as attn
from ..layers import mhc
from ..layers.embedding import embed
from ..layers.indexer import index_queries, select_topk
from ..layers.rope import cos_sin
from ..numerics import carrier, linear, round_to
from ..ops.model_calls import hc_mixes, hc_read, hc_write, rms_norm
from ..runtime.metadata import StepMetadata
from ..runtime.pools import PagedKVCache, PoolSpec
from ..runtime.step_view import entries_per_block
from .deepseek_v4 import DeepseekV4Model, LayerWeights
from .deepseek_v4_incremental import new_entries
from .grouped_attention import (
    attend,
    compress_new,
    compressed_entries,
    grouped_index_scores,
    query_block_rows,
    row_blocks,
    swa_keys,
)


def v4_cache_specs(cfg: ModelConfig, block_size: int) -> list[PoolSpec]:
    specs = []
    for layer, spec in enumerate(cfg.attention):
        specs.append(PoolSpec(f"swa.{layer}", block_size, cfg.head_dim))
        if spec.kind == SLIDING:
            continue
        per = entries_per_block(block_size, spec.compress_ratio)
        specs.append(PoolSpec(f"hidden.{layer}", block_size, cfg.hidden_size))
        specs.append(PoolSpec(f"comp.{layer}", per, cfg.head_dim))
        if spec.has_indexer:
            specs.append(PoolSpec(f"index_k.{layer}", per, cfg.index_head_dim))
    return specs


def _write_overlapping_entries(layer, y, meta, cache, w: LayerWeights, spec: AttentionSpec, eps, act) -> None:
    """CSA's overlapping compressor pools two blocks per entry: continue it per sequence (only those
    whose block completes in this step)."""
    r = spec.compress_ratio
    done = np.flatnonzero(meta.ends // r > meta.starts // r)
    for i in done.tolist():
        x = y[meta.rows(i)]
        args = (r, True, spec.rope, eps, act)
        first, entries = new_entries(cache, meta, i, f"hidden.{layer}", x, w.compressor, *args)
        slots = meta.entry_slots(i, first, first + entries.keys.shape[0], r)
        cache.write(f"comp.{layer}", slots, entries.keys)
        if w.indexer is not None:
            idx = new_entries(cache, meta, i, f"hidden.{layer}", x, w.indexer.compressor, *args)[1]
            cache.write(f"index_k.{layer}", slots, idx.keys)


def _attention(
    layer: int,
    y: torch.Tensor,
    meta: StepMetadata,
    cache: PagedKVCache,
    blocks: list,
    w: LayerWeights,
    spec: AttentionSpec,
    cfg: ModelConfig,
    act: torch.dtype,
) -> torch.Tensor:
    """One attention layer: every row's keys into the pools first, then the query side per row block
    (`blocks`, `grouped_attention.row_blocks`: one block unless the step is long)."""
    eps = cfg.rms_norm_eps
    cos, sin = cos_sin(spec.rope, meta.positions)
    cache.write(f"swa.{layer}", meta.write_slots, attn.project_latent(y, w.attn, cos, sin, eps, act))
    if w.compressor is not None:
        cache.write(f"hidden.{layer}", meta.write_slots, y)
        if spec.overlap:
            _write_overlapping_entries(layer, y, meta, cache, w, spec, eps, act)
        else:
            r = spec.compress_ratio
            new = compress_new(cache, meta, f"hidden.{layer}", y, w.compressor, r, spec.rope, eps, act)
            if new is not None:
                cache.write(f"comp.{layer}", new.slots, new.keys)
    outs = [
        _attend_rows(layer, y[lo:hi], cos[lo:hi], sin[lo:hi], bmeta, groups, cache, w, spec, cfg, act)
        for lo, hi, bmeta, groups in blocks
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_rows(layer, y, cos, sin, meta: StepMetadata, groups, cache, w, spec, cfg, act) -> torch.Tensor:
    """The query side for the rows `meta` describes (their keys are in the pools): queries, the indexer's
    top-k (CSA), attention over the window and the compressed entries, output projection."""
    eps = cfg.rms_norm_eps
    q, q_lat = attn.project_query(y, w.attn, cfg.num_attention_heads, cos, sin, eps, cfg.q_head_norm, act)
    compressed = w.compressor is not None
    if compressed and w.indexer is not None:
        qi = index_queries(q_lat, w.indexer, cfg.index_n_heads, cos, sin, act)
        head_w = linear(y, w.indexer.weights_proj, act)
    out = torch.empty(y.shape[0], cfg.num_attention_heads, cfg.head_dim, dtype=carrier(), device=y.device)
    for g in groups:
        window = swa_keys(cache, meta, g, f"swa.{layer}", cfg.sliding_window)
        extra = None
        if compressed:
            r = spec.compress_ratio
            entries, comp_visible = compressed_entries(cache, meta, g, f"comp.{layer}", r)
            if w.indexer is not None:
                index_k = compressed_entries(cache, meta, g, f"index_k.{layer}", r)[0]
                scores = grouped_index_scores(qi, index_k, head_w, g, cfg.index_score_scale, act)
                # attend gathers the selected entries only (HCA: every visible entry, as a mask)
                comp_visible = select_topk(scores, comp_visible, cfg.index_topk)
            extra = (entries, comp_visible)
        out[g.packed_rows] = attend(q, window, g, w.attn.sinks, cfg.head_dim**-0.5, meta, extra, act)
    return attn.project_output(round_to(out, act), w.attn, cfg.o_groups, cos, sin, act)


@torch.inference_mode()
def v4_paged_forward(model: DeepseekV4Model, meta: StepMetadata, cache: PagedKVCache) -> torch.Tensor:
    """FP32 logits [len(meta.logits_rows), vocab] of one packed step, updating `cache`."""
    cfg, act = model.config, model.dtype
    ids = meta.input_ids
    trunk = mhc.expand(round_to(embed(ids, model.embed, checked=meta.ids_checked), act), cfg.hc_mult)
    hc_args = (cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters)
    ratios = [spec.compress_ratio for spec in cfg.attention if spec.kind != SLIDING]
    rows = query_block_rows(meta, cfg.num_attention_heads, cfg.head_dim, min(ratios, default=None))
    blocks = row_blocks(meta, rows)
    for layer, (spec, w) in enumerate(zip(cfg.attention, model.layers)):
        pre, post, comb = hc_mixes(trunk, w.attn_hc, *hc_args)
        y = rms_norm(hc_read(trunk, pre, act), w.attn_norm, cfg.rms_norm_eps, act)
        a = _attention(layer, y, meta, cache, blocks, w, spec, cfg, act)
        trunk = hc_write(a, trunk, post, comb, act)
        pre, post, comb = hc_mixes(trunk, w.ffn_hc, *hc_args)
        y = rms_norm(hc_read(trunk, pre, act), w.ffn_norm, cfg.rms_norm_eps, act)
        h = model.moe_fn(layer, w, y, ids)  # all experts in-process, or expert parallel
        trunk = hc_write(h, trunk, post, comb, act)
    trunk = trunk[meta.logits_rows]  # the head only runs where logits are returned
    weights = mhc.head_weights(trunk, model.hc_head, cfg.hc_eps, cfg.rms_norm_eps)
    hidden = rms_norm(hc_read(trunk, weights, act), model.norm, cfg.rms_norm_eps, act)
    return linear(hidden, model.head, torch.float32).float()
