"""One attention layer of the paged step: every row's keys into the pools, then the query side per
row block (queries, index scores and top-k selection, attention, output projection)."""

from __future__ import annotations

import numpy as np
import torch

from .... import batch_invariant
from ....layers.attention import project_latent, project_output, project_query
from ....layers.indexer import index_queries, select_topk
from ....layers.rope import cos_sin
from ....numerics import carrier, linear, narrow_act, round_narrow
from ....runtime.metadata import StepMetadata
from ....runtime.pools import PagedKVCache
from ....runtime.step_view import StepView
from ...grouped_attention import (
    Group,
    attend,
    compress_new,
    compressed_entries,
    entry_validity,
    grouped_index_scores,
    invariant_selection,
    swa_keys,
)
from ..model import DeepseekV41ForCausalLM
from ..sparse import candidate_blocks, candidate_mask, index_keys
from ..yoco_step import YocoStep
from .static_attention import _static_candidate_topk, _static_selected
from .step_state import _StepState


def _attention(
    model: DeepseekV41ForCausalLM,
    layer: int,
    y: torch.Tensor,
    meta: StepView,
    cache: PagedKVCache,
    st: _StepState,
) -> torch.Tensor:
    """One attention layer over the step's rows: the keys of every row first (SWA latents, compressed and
    index keys into the pools), then the query side (`_attend_rows`), per row block of a long step."""
    cfg, topo, act, kvq = model.config, model.config.topology, model.act_dtype, model.kvq
    w = model.weights.layers[layer]
    ratio = cfg.compress_ratios[layer]
    eps = cfg.rms_norm_eps
    rope = cfg.compress_rope() if ratio else cfg.main_rope()
    # YOCO truncation: consumer queries are `qmeta`'s rows and see no SWA key below their rect_lo;
    # compressed KV / index keys (from S) stay built over every row of `meta`.
    yoco = st.yoco if topo.is_consumer_half(layer) else None
    split = st.split  # context parallel: `y` holds this rank's rows, the keys are gathered
    qmeta = yoco.qmeta if yoco else (meta if split is None else split.qmeta)
    cos, sin = cos_sin(rope, qmeta.positions)
    latent = kvq.swa(project_latent(y, w.attn, cos, sin, eps, act))
    if split is not None:  # per-row projection: gathering the local latents equals projecting every row
        latent = split.gather(latent)
    if yoco is None:
        cache.write(f"swa.{layer}", meta.write_slots, latent)
    else:  # keys below rect_lo are never visible: not stored (the tag pool says so)
        stored = qmeta.cached(("yoco_stored",), lambda: _stored_rows(qmeta, yoco))
        cache.write(f"swa.{layer}", qmeta.write_slots[stored], latent[stored])
    n_tok = y.shape[0]
    if ratio and topo.is_kv_source(layer):
        x = st.shared_hidden if topo.is_consumer_half(layer) else (y if split is None else split.gather(y))
        hidden = f"hidden.{layer}" if ratio > 1 else None
        if hidden:
            cache.write(hidden, meta.write_slots, x)
        new = compress_new(cache, meta, hidden, x, w.compressor, ratio, rope, eps, act)
        if new is not None:
            new.keys = kvq.main(new.keys)  # attention reads the cached (quantised) keys
            cache.write(f"comp.{layer}", new.slots, new.keys)
        st.fresh[layer] = new
    if ratio and topo.is_index_k_source(layer):
        new = st.fresh[topo.kv_source[layer]]
        if new is not None:
            k = index_keys(new.pre_rope, new.positions, w.indexer.wk, w.indexer.k_norm, rope, eps, act)
            cache.write(f"index_k.{layer}", new.slots, kvq.index(k))
    if ratio and topo.is_index_source(layer):
        st.selection[layer] = torch.full((n_tok, cfg.index_topk), -1, dtype=torch.long, device=y.device)
        if layer == topo.candidate_source:
            st.candidates = torch.full(
                (n_tok, topo.candidate_topk_blocks), -1, dtype=torch.long, device=y.device
            )
    outs = [
        _attend_rows(model, layer, y[lo:hi], cos[lo:hi], sin[lo:hi], bmeta, groups, lo, cache, st, yoco)
        for lo, hi, bmeta, groups in st.query_blocks(yoco is not None)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_rows(
    model: DeepseekV41ForCausalLM,
    layer: int,
    y: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qmeta: StepView,
    groups: list[Group],
    row0: int,
    cache: PagedKVCache,
    st: _StepState,
    yoco: YocoStep | None,
) -> torch.Tensor:
    """The query side of one attention layer for the rows `qmeta` describes (the step's rows from `row0`
    on; their keys are in the pools): queries, index scores and top-k selection (into the step's
    cross-layer state), attention over the window and the selected entries, output projection."""
    cfg, topo, act, kvq = model.config, model.config.topology, model.act_dtype, model.kvq
    w = model.weights.layers[layer]
    ratio = cfg.compress_ratios[layer]
    q, q_lat = project_query(y, w.attn, cfg.num_attention_heads, cos, sin, cfg.rms_norm_eps, False, act, True)
    index_source = ratio and topo.is_index_source(layer)
    if index_source:
        qi = kvq.index(index_queries(q_lat, w.indexer, cfg.index_n_heads, cos, sin, act))
        head_w = linear(y, w.indexer.weights_proj, act)
    # the attention output is rounded to act_dtype before the output projection: stored so where it may be
    out_dtype = act if narrow_act(act) else carrier()
    whole = len(groups) == 1 and groups[0].covers_step  # the group's rows are the step's: no scatter
    out = None if whole else y.new_empty(y.shape[0], cfg.num_attention_heads, cfg.head_dim, dtype=out_dtype)
    static = qmeta.graph_safe
    invariant = batch_invariant.enabled()
    for g in groups:
        slots = g.slot_rows  # every (padded) query slot; padding duplicates its sequence's last query
        step_slots = slots if row0 == 0 else slots + row0  # the same slots among the step's rows
        floor = None if yoco is None else yoco.rect_lo[g.seqs]
        window = swa_keys(cache, qmeta, g, f"swa.{layer}", cfg.sliding_window, floor)
        extra = own = None
        if ratio:
            if static:  # the attention gathers the selected entries itself (below): no read of all of them
                entries, valid = None, qmeta.cached(("comp", g.index, ratio), None)[2]
            elif invariant:  # the selected entries only (below)
                entries, valid = None, entry_validity(qmeta, g, ratio)
            else:
                entries, valid = compressed_entries(cache, qmeta, g, f"comp.{topo.kv_source[layer]}", ratio)
            n = valid.shape[1]
            if index_source and static and topo.restricted_to_candidates(layer):
                ik_pool = f"index_k.{topo.index_k_source[layer]}"
                st.selection[layer][slots] = _static_candidate_topk(
                    cache,
                    qmeta,
                    g,
                    ik_pool,
                    ratio,
                    qi,
                    head_w,
                    st.candidates[slots],
                    topo,
                    cfg.index_topk,
                    act,
                )
            elif index_source:
                ik = compressed_entries(cache, qmeta, g, f"index_k.{topo.index_k_source[layer]}", ratio)[0]
                # (ratio: the kernel skips the entries each row cannot see; `valid` masks them below)
                scores = round_narrow(grouped_index_scores(qi, ik, head_w, g, False, act, ratio), act)
                allowed = valid
                if topo.restricted_to_candidates(layer):
                    allowed = valid & candidate_mask(st.candidates[step_slots], n, topo.candidate_block_size)
                st.selection[layer][step_slots] = select_topk(scores, allowed, cfg.index_topk)
                if layer == topo.candidate_source:
                    st.candidates[step_slots] = candidate_blocks(
                        scores, valid, topo.candidate_block_size, topo.candidate_topk_blocks
                    )
            selected = st.selection[topo.index_source[layer]][step_slots]
            if invariant:  # shared entry tiles for short contexts, own keys for long (see there)
                comp = f"comp.{topo.kv_source[layer]}"
                extra, own = invariant_selection(cache, qmeta, g, comp, ratio, selected)
            elif static:
                extra = _static_selected(cache, qmeta, f"comp.{topo.kv_source[layer]}", ratio, selected)
            else:
                extra = (entries, selected)  # attend gathers the selected entries only
        o = attend(q, window, g, w.attn.sinks, cfg.head_dim**-0.5, qmeta, extra, act, own)
        if whole:
            out = o.to(out_dtype)
        else:
            out[g.packed_rows] = o.to(out_dtype)  # (index_put takes its own dtype: the rounding to act_dtype)
    return project_output(round_narrow(out, act), w.attn, cfg.o_groups, cos, sin, act, narrow=True)


def _stored_rows(qmeta: StepMetadata, yoco: YocoStep) -> torch.Tensor:
    """Rows of `qmeta` at or above their sequence's rect_lo (the consumer SWA keys that are stored), as an
    index tensor built on the host (a boolean mask on the device would cost a host sync per layer)."""
    seq_of = np.repeat(np.arange(qmeta.num_seqs), qmeta.query_lens)
    return qmeta.dev(np.flatnonzero(qmeta.host_positions >= yoco.rect_lo[seq_of]))
