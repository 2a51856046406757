"""V4.1 attention of one backbone layer (spec v41-model §4): SWA-only, C2 and C1, with cross-layer sharing.

Every layer has its own queries and sliding-window latent. Compressed layers add sparse keys: KV
sources compress (producer half: from the layer's own input; YOCO consumer half: from the shared
hidden `S`), index sources score and select top-k (optionally only inside the candidate blocks), and
consumers reuse their source's compressed KV / index keys / selection from `CrossLayerState`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...layers.attention import (
    compressed_visible,
    project_latent,
    project_output,
    project_query,
    sink_attention,
    sliding_window_visible,
)
from ...layers.compressor import Compressed, compress
from ...layers.indexer import index_queries, index_scores, select_topk, selection_mask
from ...layers.rope import cos_sin
from ...numerics import linear, round_to
from .config import DeepseekV41Config
from .kv_quant import EXACT_KV, KVQuant
from .sparse import candidate_blocks, candidate_mask, index_keys
from .weights import BlockWeights


@dataclass
class CrossLayerState:
    """What later layers of one forward take from their sources (§4.10): the latest of each kind."""

    kv: Compressed | None = None  # latest KV source's compressed entries (pre-RoPE latent and keys)
    kv_layer: int | None = None
    index_keys: torch.Tensor | None = None  # latest index-K source's keys [n, d_i]
    index_k_layer: int | None = None
    selection: torch.Tensor | None = None  # latest index source's top-k [T, index_topk], -1 padded
    selection_layer: int | None = None
    candidates: torch.Tensor | None = None  # candidate source's blocks [T, topk_blocks]
    shared_hidden: torch.Tensor | None = None  # YOCO S: first consumer's attention input


@dataclass
class AttentionTrace:
    """Per-layer view of what attention used (for tests and cache-equivalence checks)."""

    layer: int
    y: torch.Tensor
    swa_keys: torch.Tensor
    compressed: Compressed | None = None
    index_keys: torch.Tensor | None = None
    index_scores: torch.Tensor | None = None
    selection: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


def layer_attention(
    cfg: DeepseekV41Config,
    layer: int,
    w: BlockWeights,
    y: torch.Tensor,
    positions: torch.Tensor,
    state: CrossLayerState,
    act_dtype: torch.dtype = torch.float32,
    kvq: KVQuant = EXACT_KV,
    swa_lower_bound: int = 0,
    query_rows: torch.Tensor | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, AttentionTrace]:
    """Attention output [T, H] of backbone layer `layer` for one sequence (`y` = its normed HC read).

    `swa_lower_bound` hides SWA keys at positions below it (YOCO bounded replay, §8 item 5); the trace's
    `swa_keys` then hold only the keys at positions >= the bound. `y` may hold any increasing subset of
    the sequence's rows (`positions` says which; YOCO compact passes the kept rows): SWA keys come from
    those rows, compressed KV of a consumer-half KV source from `state.shared_hidden` (every row).
    `query_rows` (context parallel): compute queries, index scores, selections and outputs only for
    these rows of `y` (keys always come from every row); the output is then `[len(query_rows), H]`,
    and `state.selection` / `state.candidates` hold those rows for the consumer layers.
    With `gather` (collective, local rows -> every row in order) `y` holds only the `query_rows` rows:
    keys are projected from them and all-gathered - the SWA latent (head_dim per token) on every layer,
    the layer input (hidden per token) only on producer-half KV sources; `state.shared_hidden` must
    already hold every row.
    """
    ratio = cfg.compress_ratios[layer]
    topo = cfg.topology
    eps = cfg.rms_norm_eps
    rope = cfg.compress_rope() if ratio else cfg.main_rope()
    cos, sin = cos_sin(rope, positions)
    # Query side: every row, or only `query_rows` (all math is per row, so the rows are bitwise equal).
    yq, pos_q, cos_q, sin_q = y, positions, cos, sin
    if query_rows is not None:
        pos_q, cos_q, sin_q = positions[query_rows], cos[query_rows], sin[query_rows]
        yq = y if gather is not None else y[query_rows]
    q, q_lat = project_query(yq, w.attn, cfg.num_attention_heads, cos_q, sin_q, eps, False, act_dtype)
    if gather is None:
        swa = kvq.swa(project_latent(y, w.attn, cos, sin, eps, act_dtype))
    else:  # per-row projection, so gathering the local latents equals projecting every row
        swa = kvq.swa(gather(project_latent(yq, w.attn, cos_q, sin_q, eps, act_dtype)))
    swa_pos = positions
    if swa_lower_bound > 0:
        # Keys below the bound are invisible to every query: drop them, so YOCO `mask` (all rows) and
        # `compact` (kept rows only) attend over the very same key tensor and agree bit for bit.
        swa, swa_pos = swa[positions >= swa_lower_bound], positions[positions >= swa_lower_bound]
    visible = sliding_window_visible(pos_q, swa_pos, cfg.sliding_window)
    keys = swa
    trace = AttentionTrace(layer, y, swa)
    if ratio:
        if topo.is_kv_source(layer):
            x = state.shared_hidden if topo.is_consumer_half(layer) else (y if gather is None else gather(y))
            comp = compress(x, w.compressor, ratio, False, rope, eps, 0, act_dtype)
            comp.keys = kvq.main(comp.keys)  # attention reads the cached (quantised) keys
            state.kv = comp
            state.kv_layer = layer
        comp = state.kv
        n = comp.keys.shape[0]
        valid = compressed_visible(pos_q, n, ratio)
        if topo.is_index_source(layer):
            if topo.is_index_k_source(layer):
                state.index_keys = kvq.index(
                    index_keys(
                        comp.pre_rope, comp.positions, w.indexer.wk, w.indexer.k_norm, rope, eps, act_dtype
                    )
                )
                state.index_k_layer = layer
            qi = kvq.index(index_queries(q_lat, w.indexer, cfg.index_n_heads, cos_q, sin_q, act_dtype))
            head_w = linear(yq, w.indexer.weights_proj, act_dtype)
            # No scale in V4.1; the logits are stored in the activation dtype (BF16 in the engine).
            scores = round_to(index_scores(qi, state.index_keys, head_w, False, act_dtype), act_dtype)
            allowed = valid
            if topo.restricted_to_candidates(layer):
                allowed = valid & candidate_mask(state.candidates, n, topo.candidate_block_size)
            state.selection = select_topk(scores, allowed, cfg.index_topk)
            state.selection_layer = layer
            if layer == topo.candidate_source:
                state.candidates = candidate_blocks(
                    scores, valid, topo.candidate_block_size, topo.candidate_topk_blocks
                )
            trace.index_scores = scores
        keys = torch.cat((swa, comp.keys), dim=0)
        visible = torch.cat((visible, selection_mask(state.selection, n)), dim=1)
        trace.compressed, trace.index_keys = comp, state.index_keys
        trace.selection, trace.candidates = state.selection, state.candidates
    o = sink_attention(q, keys, visible, w.attn.sinks, cfg.head_dim**-0.5, act_dtype)
    return project_output(round_to(o, act_dtype), w.attn, cfg.o_groups, cos_q, sin_q, act_dtype), trace
