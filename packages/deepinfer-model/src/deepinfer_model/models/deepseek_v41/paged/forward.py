"""The eager paged forward of one packed step (the graph-safe step runs it over static metadata)."""

from __future__ import annotations

import torch

from ....layers.embedding import embed
from ....numerics import logits as head_logits
from ....ops.model_calls import hc_read, rms_norm
from ....runtime.cp_rows import PagedMirrorRows
from ....runtime.pools import PagedKVCache
from ....runtime.step_view import StepView
from ..blocks import ShiftedHC
from ..drafter import main_keys
from ..drafter_heads import target_features
from ..engram import engram_inject
from ..model import DeepseekV41ForCausalLM
from ..vision.embed import image_input_embeddings
from ..vision.tokens import IMAGE
from ..yoco_step import YocoStep
from .attention import _attention
from .engram_rows import _engram_rows, _static_engram_rows
from .step_state import _StepState, query_block_rows


@torch.no_grad()
def v41_paged_forward(
    model: DeepseekV41ForCausalLM,
    meta: StepView,
    cache: PagedKVCache,
    yoco: YocoStep | None = None,
    moe_fn=None,
    row_split: PagedMirrorRows | None = None,
    images: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP32 logits [len(meta.logits_rows), vocab] of one packed step, updating `cache`.

    `moe_fn` replaces `model.moe_fn` for this call (the graph-safe decode step passes `static_moe`).

    `yoco` (the step's truncation plan, `yoco_step`): consumer layers clip SWA visibility at each
    sequence's rect_lo and, in compact mode, run only the kept rows (the stateless forward's
    `yoco_keep_tokens` / `yoco_mode` / `yoco_prompt_len`, bitwise).

    `row_split` (context parallel, `runtime.cp_rows`): the per-token work runs on this CP rank's rows,
    attention computes its queries only; every key, the shared hidden, the drafter's features and the
    final hidden are all-gathered, so every CP rank writes the whole step into its pools and returns the
    whole step's logits (collective over the CP group).

    `images`: the input embeddings [n, H] of the step's image positions (ids equal to the IMAGE sentinel)
    in packed row order; the other sentinel rows take the learned start / newline / end embeddings and the
    pad token's (`vision/embed.py`, as the stateless forward's `image_features`). Embeddings are per
    position, so a prefill chunk may end anywhere inside an image block, a CP rank embeds the image
    positions among its rows alone, and YOCO truncation (which acts after the embedding) takes them as any
    input rows.
    """
    if row_split is not None and yoco is not None:
        raise ValueError("context parallel steps cannot be combined with YOCO prefill truncation")
    split = row_split
    cfg, w, act = model.config, model.weights, model.act_dtype
    if moe_fn is None:  # (not `moe_fn or ...`: Dynamo before torch 2.15 cannot take the truth of a nested
        moe_fn = model.moe_fn  # function and breaks the compiled decode step's graph there)
    static = meta.graph_safe
    rows = (_static_engram_rows if static else _engram_rows)(model, meta, cache) if model.engram else {}
    qmeta = meta if split is None else split.qmeta  # the rows whose queries this rank computes
    st = _StepState(qmeta, yoco, None if static else query_block_rows(model, qmeta))
    st.split = split
    compact = yoco is not None and yoco.drops_rows
    targets = cfg.dspark.target_layer_ids if (cfg.dspark and w.drafter is not None) else ()
    feats = {}
    if images is None:
        x0 = embed(qmeta.input_ids, w.embed, checked=meta.ids_checked)
    elif w.image_embeds is None:
        raise ValueError("a step with images, but this checkpoint has no vision tower")
    else:
        pad = int(cfg.extra.get("pad_token_id", 2))
        if split is not None:  # this rank's image positions: their rows of `images` (packed row order)
            is_image = meta.input_ids == w.embed.shape[0] + IMAGE
            order = torch.cumsum(is_image.to(torch.int64), 0) - 1
            images = images[split.local(order)[split.local(is_image)].to(images.device)]
        x0 = image_input_embeddings(qmeta.input_ids, w.embed, w.image_embeds, pad, [images], act)
    hc = ShiftedHC(x0, cfg)
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
            if split is not None:
                r = split.local(r)
            hc.trunk = engram_inject(hc.trunk, r, blk.engram, cfg.rms_norm_eps, act)
        if layer in targets:
            feats[layer] = target_features(hc.trunk, act)

        def attention(y, layer=layer):
            if layer == cfg.n_prefill_layer and not compact:
                # YOCO: consumer-half compressed KV is projected from S (every row: gathered under CP)
                st.shared_hidden = y if split is None else split.gather(y)
            return _attention(model, layer, y, meta, cache, st)

        hc.sublayer(blk.hc_attn, blk.attn_norm, attention, act)
        # the model's MoE hook: all experts in-process, or expert parallel (deepinfer_model.parallel)
        hc.sublayer(blk.hc_ffn, blk.ffn_norm, lambda y, layer=layer, blk=blk: moe_fn(layer, blk, y), act)
    if targets:
        features = torch.cat([feats[t] for t in targets], dim=1)
        if split is not None:
            features = split.gather(features)
        # compact with consumer-side targets: features exist for the kept rows only (§8 item 6)
        fmeta = yoco.qmeta if compact and features.shape[0] != meta.positions.shape[0] else meta
        keys = main_keys(cfg, w.drafter, features, fmeta.positions, act, model.kvq)
        for i in range(keys.shape[0]):
            cache.write(f"draft_main.{i}", fmeta.write_slots, keys[i])
    logits_rows = yoco.qmeta.logits_rows if compact else meta.logits_rows
    final = hc.final(act) if split is None else split.gather(hc.final(act))
    hidden = rms_norm(final[logits_rows], w.norm, cfg.rms_norm_eps, act)
    return head_logits(hidden, w.head, act)  # FP32 logits (§2.1)
