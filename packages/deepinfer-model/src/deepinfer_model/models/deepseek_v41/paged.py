"""DeepSeek-V4.1 run incrementally over a packed batch with paged caches (spec v41-model §4.9-4.11).

Per-token blocks (Engram injection, shifted mHC, projections, MoE) run once over the packed tokens of
all sequences; attention is the only place that needs the past, and reads it from paged pools:

- `swa.L`      every layer: the token's sliding-window latent (FP8-rounded with `quantize_kv`).
- `comp.L`     KV-source layers (C2 ratio 2, C1 ratio 1): one compressed key per entry; consumer
               layers read their source's pool (`topology.kv_source`), never a copy.
- `hidden.L`   KV sources with ratio > 1: the compressor input of every token (the producer half's own
               attention input, the consumer half's YOCO shared hidden S), i.e. the state of blocks not
               complete yet.
- `index_k.L`  index-K source layers: one index key per entry; index sources read their index-K
               source's pool.
- `token_ids`  with Engram: raw token ids, for the n-gram context of the first tokens of a step.

Selections and candidate blocks are per query, so they are passed between layers within the step
(per sequence), exactly as the stateless forward's `CrossLayerState`. The drafter is not run here
(the runner contract returns logits only, like the recompute runner).
"""

from __future__ import annotations

import numpy as np
import torch

from ... import batch_invariant
from ...layers.attention import project_latent, project_output, project_query
from ...layers.embedding import embed
from ...layers.experts import ExpertWeights, experts_forward_static
from ...layers.indexer import index_queries, select_topk
from ...layers.rope import cos_sin
from ...layers.router import route_topk, router_logits
from ...numerics import carrier, linear, narrow_act, round_narrow
from ...numerics import logits as head_logits
from ...ops.model_calls import hc_read, rms_norm
from ...runtime.metadata import StepMetadata
from ...runtime.pools import TOKEN_IDS, PagedKVCache, PoolSpec
from ...runtime.static_metadata import StaticDecodeMetadata
from ...runtime.step_view import StepView, entries_per_block
from ..grouped_attention import (
    Group,
    NewEntries,
    attend,
    compress_new,
    compressed_entries,
    entry_validity,
    grouped_index_scores,
    invariant_selection,
    mark_pool_values,
    ranges,
    row_blocks,
    swa_keys,
)
from ..grouped_attention import query_block_rows as groups_query_block_rows
from .blocks import ShiftedHC
from .drafter import DraftOutput, Sampler, draft_blocks, draft_blocks_static, greedy, main_keys
from .drafter_heads import confidence_temperatures, target_features
from .engram import engram_inject
from .engram_hash import engram_hash
from .model import DeepseekV41ForCausalLM
from .sparse import candidate_blocks, candidate_mask, index_keys
from .yoco_step import YocoStep

KT = batch_invariant.KEY_TILE


def v41_cache_specs(model: DeepseekV41ForCausalLM, block_size: int) -> list[PoolSpec]:
    cfg, topo = model.config, model.config.topology
    specs = []
    if model.engram is not None:
        specs.append(PoolSpec(TOKEN_IDS, block_size, 1, torch.int64))
    for layer, ratio in enumerate(cfg.compress_ratios[: topo.num_layers]):
        specs.append(PoolSpec(f"swa.{layer}", block_size, cfg.head_dim))
        if not ratio:
            continue
        per = entries_per_block(block_size, ratio)
        if topo.is_kv_source(layer):
            specs.append(PoolSpec(f"comp.{layer}", per, cfg.head_dim))
            if ratio > 1:
                specs.append(PoolSpec(f"hidden.{layer}", block_size, cfg.hidden_size))
        if topo.is_index_k_source(layer):
            specs.append(PoolSpec(f"index_k.{layer}", per, cfg.index_head_dim))
    if model.weights.drafter is not None:  # each draft block's main key of every processed token (§7.2)
        for i in range(len(model.weights.drafter.blocks)):
            specs.append(PoolSpec(f"draft_main.{i}", block_size, cfg.head_dim))
    return specs


def query_block_rows(model: DeepseekV41ForCausalLM, meta: StepMetadata) -> int:
    """Rows per query block of `_attention` for this step (>= every row: one block)."""
    cfg = model.config
    ratios = [r for r in cfg.compress_ratios[: cfg.topology.num_layers] if r]
    return groups_query_block_rows(meta, cfg.num_attention_heads, cfg.head_dim, min(ratios, default=None))


class _StepState:
    """Cross-layer values of this step (the paged counterpart of `CrossLayerState`), packed per token."""

    def __init__(self, meta: StepView, yoco: YocoStep | None = None, block_rows: int | None = None) -> None:
        self.meta, self.yoco, self.block_rows = meta, yoco, block_rows
        self._blocks: dict[bool, list] = {}  # consumer half's metadata or not -> its query blocks
        self.fresh: dict[int, NewEntries | None] = {}  # kv source -> entries completed in this step
        self.selection: dict[int, torch.Tensor] = {}  # index source -> top-k [N, index_topk]
        self.candidates: torch.Tensor | None = None  # [N, candidate_topk_blocks]
        self.shared_hidden: torch.Tensor | None = None

    def query_blocks(self, consumer: bool) -> list[tuple[int, int, StepView, list[Group]]]:
        """(first row, end row, metadata, groups) of each query block of the step's rows (the consumer
        half's rows with YOCO truncation, which are the step's unless compact mode drops some): the whole
        step when it has at most `block_rows` rows (always for the graph-safe step), else consecutive
        row blocks as `StepMetadata.row_block` steps. Built once per step: their index tensors are shared
        by every layer."""
        # keyed by which metadata, not by its id: a compiled step would guard on the object's identity and
        # recompile for every (bucket, tier) metadata object
        key = consumer and self.yoco is not None
        qmeta = self.yoco.qmeta if key else self.meta
        if key not in self._blocks:
            if qmeta.graph_safe:
                self._blocks[key] = [(0, qmeta.positions.shape[0], qmeta, _static_groups(qmeta))]
            else:
                self._blocks[key] = row_blocks(qmeta, self.block_rows)
        return self._blocks[key]


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
    qmeta = yoco.qmeta if yoco else meta
    cos, sin = cos_sin(rope, qmeta.positions)
    latent = kvq.swa(project_latent(y, w.attn, cos, sin, eps, act))
    if yoco is None:
        cache.write(f"swa.{layer}", meta.write_slots, latent)
    else:  # keys below rect_lo are never visible: not stored (the tag pool says so)
        stored = qmeta.cached(("yoco_stored",), lambda: _stored_rows(qmeta, yoco))
        cache.write(f"swa.{layer}", qmeta.write_slots[stored], latent[stored])
    n_tok = y.shape[0]
    if ratio and topo.is_kv_source(layer):
        x = st.shared_hidden if topo.is_consumer_half(layer) else y
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


def _static_selected(
    cache: PagedKVCache, meta: StaticDecodeMetadata, pool: str, ratio: int, selected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend`'s `extra` for the graph-safe step, reading only the top-k selected entries of every row
    (fixed shape [N, k, D]) from `pool` instead of every entry up to the context tier: the picked entries
    as each row's own entry list, and indices 0 .. k-1 into it (-1 kept). `attend` then gathers the same
    values the eager step gathers from the full entry list; an unselected (-1) column is zero here (the
    eager step re-reads entry 0 or its zero padding: either way finite, at zero probability)."""
    none = selected < 0
    slots = meta.dev_entry_slots(selected.clamp(min=0), ratio)  # [N, k]
    picked = cache.read(pool, slots).masked_fill(none[..., None], 0.0)  # [N, k, D]
    k = selected.shape[1]
    own = torch.arange(k, device=selected.device).expand_as(selected)
    return picked, torch.where(none, selected, own)


def _frame_tiles(entries: torch.Tensor, n_tiles: int, cap: int) -> torch.Tensor:
    """The distinct key tiles (entry // KEY_TILE) of each row's `entries` [N, m] (-1 = none), ascending,
    the first `cap` of them (a row has at most min(m, n_tiles)), `n_tiles` where a row has fewer: long
    [N, cap]. Device-only (two sorts, no unique)."""
    t = torch.where(entries >= 0, torch.div(entries, KT, rounding_mode="floor"), n_tiles)
    t = torch.sort(t, dim=1).values
    dup = torch.zeros_like(t, dtype=torch.bool)
    dup[:, 1:] = t[:, 1:] == t[:, :-1]
    t = torch.sort(t.masked_fill(dup, n_tiles), dim=1).values[:, :cap]
    if t.shape[1] < cap:
        t = torch.cat((t, t.new_full((t.shape[0], cap - t.shape[1]), n_tiles)), dim=1)
    return t


def _tile_entries(tiles: torch.Tensor) -> torch.Tensor:
    """Entry ids of whole key tiles `tiles` [N, T] -> [N, T * KEY_TILE] (tile order, then column)."""
    return (tiles[:, :, None] * KT + torch.arange(KT, device=tiles.device)).flatten(1)


def _static_candidate_topk(
    cache: PagedKVCache,
    meta: StaticDecodeMetadata,
    g: Group,
    pool: str,
    ratio: int,
    qi: torch.Tensor,
    head_w: torch.Tensor,
    candidates: torch.Tensor,
    topo,
    topk: int,
    act: torch.dtype,
) -> torch.Tensor:
    """Top-k of an index source restricted to candidate blocks (spec v41-model §4.6), graph-safe and with
    a fixed shape that follows the candidate capacity instead of the context tier: each row gathers the
    index keys of its candidate blocks only ([N, blocks x block_size], ascending entry ids), scores them
    and maps the compact top-k back to entry ids. The eager step scores every entry and masks all but
    the candidates' valid ones: the same scores of the same allowed entries, and ascending compact order
    is ascending entry order, so the tie rule (lower index first) picks the same entries."""
    block = topo.candidate_block_size
    entry = (candidates.clamp(min=0)[:, :, None] * block + torch.arange(block, device=meta.device)).flatten(1)
    klen = torch.div(meta.positions + 1, ratio, rounding_mode="floor")[:, None]
    if batch_invariant.enabled():
        # the eager layout: each entry in its own column of whole key tiles (ascending), the tiles that
        # hold a candidate entry only (at most 2 per candidate block of <= KEY_TILE entries)
        width = meta.cached(("comp", g.index, ratio), None)[2].shape[1]
        n_tiles = width // KT
        per = (block + KT - 2) // KT + 1  # tiles a run of `block` consecutive entries can touch
        listed = torch.where((candidates >= 0).repeat_interleave(block, dim=1), entry, -1)
        tiles = _frame_tiles(listed, n_tiles, min(candidates.shape[1] * per, n_tiles))
        entry = _tile_entries(tiles)
        cand = candidate_mask(candidates, width + KT, block)
        allowed = cand.gather(1, entry.clamp(max=width + KT - 1)) & (entry < klen)
        keys = cache.read(pool, meta.dev_entry_slots(entry.clamp(max=width - 1), ratio))
        keys = mark_pool_values(cache, pool, keys.masked_fill(~allowed[..., None], 0.0))
        scores = round_narrow(grouped_index_scores(qi, keys, head_w, g, False, act), act)
        local = select_topk(scores, allowed, topk)
        return torch.where(local >= 0, entry.gather(1, local.clamp(min=0)), local)
    allowed = (candidates >= 0).repeat_interleave(block, dim=1) & (entry < klen)
    keys = cache.read(pool, meta.dev_entry_slots(entry, ratio)).masked_fill(~allowed[..., None], 0.0)
    scores = round_narrow(grouped_index_scores(qi, keys, head_w, g, False, act), act)
    local = select_topk(scores, allowed, topk)
    return torch.where(local >= 0, entry.gather(1, local.clamp(min=0)), local)


def _stored_rows(qmeta: StepMetadata, yoco: YocoStep) -> torch.Tensor:
    """Rows of `qmeta` at or above their sequence's rect_lo (the consumer SWA keys that are stored), as an
    index tensor built on the host (a boolean mask on the device would cost a host sync per layer)."""
    seq_of = np.repeat(np.arange(qmeta.num_seqs), qmeta.query_lens)
    return qmeta.dev(np.flatnonzero(qmeta.host_positions >= yoco.rect_lo[seq_of]))


def _engram_rows(model: DeepseekV41ForCausalLM, meta: StepMetadata, cache: PagedKVCache) -> dict:
    """Engram table rows of the packed tokens, all sequences in one hash per layer.

    Each sequence contributes a window: `N-1` context slots (earlier tokens from `token_ids`, or the
    compressed pad where the sequence has none, which is what the n-gram context holds before a
    sequence start) followed by its query tokens. Windows are concatenated; an n-gram never reaches
    back more than `N-1` slots, so none crosses into another sequence's window.
    """
    eng = model.engram
    back = eng.cfg.max_ngram_size - 1
    starts, ends, qlens = meta.starts, meta.ends, meta.query_lens
    lo = np.maximum(starts - back, 0)
    seq, pos = ranges(lo, ends)
    ids = cache.read(TOKEN_IDS, meta.dev(meta.token_slots_of(seq, pos))).reshape(-1)
    window = back + qlens
    base = np.concatenate(([0], np.cumsum(window)[:-1]))  # window start of each sequence
    flat = torch.full((int(window.sum()),), eng.vocab.pad_id, dtype=torch.long, device=meta.device)
    flat[meta.dev(base[seq] + back + pos - starts[seq])] = eng.vocab.compress(ids)
    _, query = ranges(base + back, base + window)
    query = meta.dev(query)
    return {
        layer: engram_hash(flat, eng.layout, layer, eng.multipliers[layer], eng.vocab.pad_id)[query]
        for layer in eng.cfg.layer_ids
    }


@torch.no_grad()
def v41_paged_forward(
    model: DeepseekV41ForCausalLM,
    meta: StepView,
    cache: PagedKVCache,
    yoco: YocoStep | None = None,
    moe_fn=None,
) -> torch.Tensor:
    """FP32 logits [len(meta.logits_rows), vocab] of one packed step, updating `cache`.

    `moe_fn` replaces `model.moe_fn` for this call (the graph-safe decode step passes `static_moe`).

    `yoco` (the step's truncation plan, `yoco_step`): consumer layers clip SWA visibility at each
    sequence's rect_lo and, in compact mode, run only the kept rows (the stateless forward's
    `yoco_keep_tokens` / `yoco_mode` / `yoco_prompt_len`, bitwise).
    """
    cfg, w, act = model.config, model.weights, model.act_dtype
    if moe_fn is None:  # (not `moe_fn or ...`: Dynamo before torch 2.15 cannot take the truth of a nested
        moe_fn = model.moe_fn  # function and breaks the compiled decode step's graph there)
    static = meta.graph_safe
    rows = (_static_engram_rows if static else _engram_rows)(model, meta, cache) if model.engram else {}
    st = _StepState(meta, yoco, None if static else query_block_rows(model, meta))
    compact = yoco is not None and yoco.drops_rows
    targets = cfg.dspark.target_layer_ids if (cfg.dspark and w.drafter is not None) else ()
    feats = {}
    hc = ShiftedHC(embed(meta.input_ids, w.embed, checked=meta.ids_checked), cfg)
    for layer, blk in enumerate(w.layers):
        if compact and layer == cfg.n_prefill_layer:
            # Compact boundary (§8 item 2): S for every row (consumer compressed KV / index keys need all
            # of them), then only the kept rows of the trunk, pending pre mix and selections go on.
            st.shared_hidden = rms_norm(
                hc_read(hc.trunk, hc.prev_pre, act, narrow=True),
                blk.attn_norm,
                cfg.rms_norm_eps,
                act,
                narrow=True,
            )  # (held as the sub-layer inputs are: `ShiftedHC`)
            hc.trunk, hc.prev_pre = hc.trunk[yoco.kept], hc.prev_pre[yoco.kept]
            st.selection = {k: v[yoco.kept] for k, v in st.selection.items()}
            if st.candidates is not None:
                st.candidates = st.candidates[yoco.kept]
        if blk.engram is not None:
            r = rows[layer][yoco.kept] if compact and layer >= cfg.n_prefill_layer else rows[layer]
            hc.trunk = engram_inject(hc.trunk, r, blk.engram, cfg.rms_norm_eps, act)
        if layer in targets:
            feats[layer] = target_features(hc.trunk, act)

        def attention(y, layer=layer):
            if layer == cfg.n_prefill_layer and not compact:
                st.shared_hidden = y  # YOCO: consumer-half compressed KV is projected from S
            return _attention(model, layer, y, meta, cache, st)

        hc.sublayer(blk.hc_attn, blk.attn_norm, attention, act)
        # the model's MoE hook: all experts in-process, or expert parallel (deepinfer_model.parallel)
        hc.sublayer(blk.hc_ffn, blk.ffn_norm, lambda y, layer=layer, blk=blk: moe_fn(layer, blk, y), act)
    if targets:
        features = torch.cat([feats[t] for t in targets], dim=1)
        # compact with consumer-side targets: features exist for the kept rows only (§8 item 6)
        fmeta = yoco.qmeta if compact and features.shape[0] != meta.positions.shape[0] else meta
        keys = main_keys(cfg, w.drafter, features, fmeta.positions, act, model.kvq)
        for i in range(keys.shape[0]):
            cache.write(f"draft_main.{i}", fmeta.write_slots, keys[i])
    logits_rows = yoco.qmeta.logits_rows if compact else meta.logits_rows
    hidden = rms_norm(hc.final(act)[logits_rows], w.norm, cfg.rms_norm_eps, act)
    return head_logits(hidden, w.head, act)  # FP32 logits (§2.1)


def _static_groups(meta: StaticDecodeMetadata) -> list[Group]:
    """The one group of a static step: every row (query token) is a one-query sequence (no padding
    slots); a verification step's 1 + k rows of a sequence read the same pools at their own positions."""
    rows = meta.rows_index
    n = rows.shape[0]
    qmask = torch.ones(n, 1, dtype=torch.bool, device=meta.device)
    return [Group(np.arange(n), rows[:, None], qmask, meta.positions[:, None], 0, packed_rows=rows)]


def _static_engram_rows(
    model: DeepseekV41ForCausalLM, meta: StaticDecodeMetadata, cache: PagedKVCache
) -> dict:
    """`_engram_rows` for one query per sequence with fixed shapes: each sequence's window is the N-1
    positions before its token and the token (pad where the position is negative), read from
    `token_ids` (this step's token is written there first)."""
    eng = model.engram
    back = eng.cfg.max_ngram_size - 1
    pos = meta.positions[:, None] - torch.arange(back, -1, -1, device=meta.device)[None, :]  # [N, back+1]
    ids = cache.read(TOKEN_IDS, meta.dev_token_slots(pos.clamp(min=0)).reshape(-1)).reshape(pos.shape)
    window = torch.where(pos >= 0, eng.vocab.compress(ids), eng.vocab.pad_id).reshape(-1)
    query = meta.rows_index * (back + 1) + back  # the token itself: last slot of its window
    return {
        layer: engram_hash(window, eng.layout, layer, eng.multipliers[layer], eng.vocab.pad_id)[query]
        for layer in eng.cfg.layer_ids
    }


def static_moe(model: DeepseekV41ForCausalLM, top_k: int | None = None):
    """`model.local_moe` (`blocks.moe_ffn`) with the graph-safe expert path `experts_forward_static`:
    the same router (FP32 logits, score top-k), routing weight before `w2`, same roundings. `top_k`:
    the backbone's `num_experts_per_tok` by default (the draft blocks pass their own); the returned
    function takes (layer or draft block index, its weights, input rows)."""
    cfg = model.config
    top_k = cfg.num_experts_per_tok if top_k is None else top_k

    def moe(layer: int, blk, y: torch.Tensor) -> torch.Tensor:
        w = blk.moe
        logits = router_logits(y, w.gate, model.act_dtype)
        weights, ids = route_topk(logits, w.bias, top_k, cfg.routed_scaling_factor)
        return experts_forward_static(
            y, weights, ids, w.experts, w.shared, cfg.swiglu_limit, model.act_dtype, weight_before_down=True
        )

    return moe


def static_decode_problem(model) -> str | None:
    """Why `v41_static_decode_forward` cannot run this model (None: it can)."""
    if not isinstance(model, DeepseekV41ForCausalLM):
        return f"graph-safe decode is implemented for DeepSeek-V4.1 only, not {type(model).__name__}"
    if model.moe_fn != model.local_moe:
        return "graph-safe decode needs the in-process MoE (expert parallel MoE is not graph-safe here)"
    return _moe_blocks_problem(model.weights.layers, "layer")


def _moe_blocks_problem(blocks, what: str) -> str | None:
    """Why the graph-safe expert path (`static_moe`) cannot run these blocks' MoE (None: it can);
    `what` names a block in the message ("layer", "draft block")."""
    for i, blk in enumerate(blocks):
        if blk.moe.tid2eid is not None:
            return f"{what} {i}: hash-routed MoE has no graph-safe path"
        if not isinstance(blk.moe.experts, ExpertWeights):
            return f"{what} {i}: {type(blk.moe.experts).__name__} experts have no graph-safe path"
    return None


def static_batch_invariant_problem(model: DeepseekV41ForCausalLM, drafter: bool = False) -> str | None:
    """Why the graph-safe step (`drafter`: the graph-safe draft) cannot run this model in batch-invariant
    mode on the CPU (None: it can): its expert path reproduces the eager step's grouped exact-product
    GEMMs, which need FP32-valued expert weights held in FP64 (`batch_invariant.stacked_parts`)."""
    from ...layers.experts import _bi_grouped

    blocks, what = (
        (model.weights.drafter.blocks, "draft block") if drafter else (model.weights.layers, "layer")
    )
    for i, blk in enumerate(blocks):
        ex = blk.moe.experts
        if _bi_grouped((ex.w1, ex.w3), (ex.w2,)) is None:
            return f"{what} {i}: batch-invariant experts without grouped FP64 operands (not graph-safe)"
    return None


@torch.no_grad()
def v41_static_decode_forward(
    model: DeepseekV41ForCausalLM, meta: StaticDecodeMetadata, cache: PagedKVCache
) -> torch.Tensor:
    """The graph-safe decode / verification step: FP32 logits [N, vocab], one row per query token, with
    no host sync and every shape fixed by N, the block-table width and the model (CUDA-graph
    capturable). Equal to `v41_paged_forward` of the same step on every real row; placeholder rows
    (`StaticDecodeMetadata`) write only the dummy block. Sparse attention gathers only the top-k
    selected compressed entries and the window; index sources restricted to candidate blocks score only
    those blocks; the other index sources score every entry up to the block-table width, which is the
    step's context tier (`cuda_graphs.build_context_tiers`: at most twice the longest context above the
    smallest tier), not max_context."""
    meta.reset()
    if TOKEN_IDS in cache.pools:
        cache.write(TOKEN_IDS, meta.write_slots, meta.input_ids)
    with batch_invariant.sync_free():  # (batch-invariant mode's CPU paths: no value-dependent branch)
        return v41_paged_forward(model, meta, cache, moe_fn=static_moe(model))


def v41_paged_draft(
    model: DeepseekV41ForCausalLM,
    meta: StepMetadata,
    cache: PagedKVCache,
    seqs: list[int],
    next_tokens: list[int],
    num_draft_tokens: int,
    sampler: Sampler | list[Sampler] = greedy,
    last_positions: list[int] | None = None,
) -> list[DraftOutput]:
    """One drafted block after the last position of each listed sequence of the step `meta` describes
    (which must have run), or after `last_positions[k]` (a position of that step or before it: the last
    accepted one of a verification step), starting from the token the target produced there; the
    drafter's main keys come from the `draft_main.*` pools (the last `sliding_window` positions). All
    sequences draft in one batched forward (`draft_blocks`); `sampler` is one per sequence or shared."""
    cfg, w = model.config, model.weights
    if w.drafter is None:
        raise ValueError(
            "num_draft_tokens > 0 needs a checkpoint with draft blocks (num_nextn_predict_layers > 0)"
        )
    if not 1 <= num_draft_tokens <= 32:
        raise ValueError(f"num_draft_tokens = {num_draft_tokens} must lie in [1, 32]")
    seq_arr = np.asarray(seqs, dtype=np.int64).reshape(-1)
    last = draft_last_positions(model, meta, seq_arr, next_tokens, last_positions)
    if not len(seq_arr):
        return []
    slots = meta.dev(draft_window_slots(meta, seq_arr, last, cfg.sliding_window))
    windows = torch.stack([cache.read(f"draft_main.{b}", slots) for b in range(len(w.drafter.blocks))])
    return draft_blocks(
        cfg,
        w.drafter,
        w.embed,
        w.head,
        windows,
        [int(g) for g in next_tokens],
        last.tolist(),
        num_draft_tokens,
        sampler,
        confidence_temperatures(num_draft_tokens),
        model.act_dtype,
        model.kvq,
        getattr(model, "draft_moe_fn", None),
    )


def draft_last_positions(
    model: DeepseekV41ForCausalLM,
    meta: StepMetadata,
    seqs: np.ndarray,
    next_tokens,
    last_positions=None,
) -> np.ndarray:
    """The position each listed sequence of the step `meta` drafts after (its last position, or
    `last_positions[k]`), validated with the next tokens (host ints)."""
    cfg = model.config
    last = meta.ends[seqs].astype(np.int64) - 1
    for k, g in enumerate(next_tokens):
        if not 0 <= g < cfg.vocab_size:
            raise ValueError(f"next_token = {g} must lie in [0, vocab_size={cfg.vocab_size})")
        if last_positions is not None:
            if not 0 <= last_positions[k] <= last[k]:
                raise ValueError(f"last_positions[{k}] = {last_positions[k]} must lie in [0, {last[k]}]")
            last[k] = last_positions[k]
    return last


def draft_window_slots(
    meta: StepMetadata, seqs: np.ndarray, last: np.ndarray, window: int, width: int | None = None
) -> np.ndarray:
    """Cache slots [N, width] (host) of each sequence's window of main keys in columns 0 .. L - 1
    (positions lo .. last, L = min(last + 1, window)); the columns past a shorter window re-read its
    last key (finite, never visible: the drafter masks them). `width`: default the longest L."""
    lo = np.maximum(last - window + 1, 0)
    width = int((last - lo).max()) + 1 if width is None else width
    pos = np.minimum(lo[:, None] + np.arange(width)[None, :], last[:, None])
    return meta.token_slots_of(seqs[:, None], pos)


def static_draft_problem(model) -> str | None:
    """Why `v41_static_draft` cannot run this model (None: it can)."""
    if not isinstance(model, DeepseekV41ForCausalLM) or model.weights.drafter is None:
        return "the graph-safe draft needs a DeepSeek-V4.1 model with draft blocks"
    if getattr(model, "draft_moe_fn", None) is not None:
        return "the graph-safe draft needs the drafter's in-process MoE (expert parallel is not graph-safe)"
    return _moe_blocks_problem(model.weights.drafter.blocks, "draft block")


@torch.no_grad()
def v41_static_draft(
    model: DeepseekV41ForCausalLM,
    cache: PagedKVCache,
    next_tokens: torch.Tensor,
    last_positions: torch.Tensor,
    window_slots: torch.Tensor,
    num_draft_tokens: int,
    temperatures: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The graph-safe greedy draft (`drafter.draft_blocks_static`): every input a device tensor of fixed
    shape, no host sync. `next_tokens`, `last_positions` long [N]; `window_slots` long [N, W] the
    `draft_main.*` slots of each sequence's window (`draft_window_slots(..., width=W)`); `temperatures`
    [k] the confidence temperatures. Each row equals `v41_paged_draft` with a greedy sampler for the
    same sequence, last position and next token. -> (tokens, logits, confidence, hidden, positions)."""
    cfg, w = model.config, model.weights
    windows = torch.stack([cache.read(f"draft_main.{b}", window_slots) for b in range(len(w.drafter.blocks))])
    with batch_invariant.sync_free():  # (batch-invariant mode's CPU paths: no value-dependent branch)
        return draft_blocks_static(
            cfg,
            w.drafter,
            w.embed,
            w.head,
            windows,
            next_tokens,
            last_positions,
            num_draft_tokens,
            temperatures,
            model.act_dtype,
            model.kvq,
            static_moe(model, cfg.dspark.num_experts_per_tok),
        )
