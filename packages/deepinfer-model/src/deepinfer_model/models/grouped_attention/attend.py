"""Sink attention over a group's window keys and compressed entries (the band path, the fused listed
kernel or batch-invariant mode's tiles)."""

from __future__ import annotations

import numpy as np
import torch

from ... import batch_invariant
from ...numerics import attention_operands, bmm_operand, carrier, native
from ...runtime.step_view import StepView
from . import sizes
from .groups import Group
from .listed import _listed_kernel, listed_attention
from .products import _own_keys, _shared_keys
from .selected_entries import own_entries
from .window_keys import WindowKeys


def _band_mask(meta: StepView, g: Group, wk: WindowKeys, a: int, b: int) -> torch.Tensor:
    """bool [G, b, 1, b + W - 1]: which of the band columns a .. a + b + W - 2 query slots a .. a + b - 1
    see (their window, at or above the floor; padding slots sit at their sequence's last position, so
    they may see none: their rows are finite and never written back). Built on the host, once per step."""

    def make():
        kp = wk.base[:, None] + a + np.arange(b + wk.window - 1)[None, :]  # [G, C] key positions
        # (metadata without host copies: read the positions back once)
        host_q = g.host_q_pos if g.host_q_pos is not None else g.q_pos.cpu().numpy()
        qp = host_q[:, a : a + b, None]  # [G, b, 1]
        vis = (kp[:, None, :] <= qp) & (kp[:, None, :] > qp - wk.window) & (kp >= wk.low[:, None])[:, None, :]
        return meta.dev(vis[:, :, None, :])

    return meta.cached(("band", *wk.index_key, a, b), make)


def attend(
    q: torch.Tensor,
    swa: WindowKeys,
    g: Group,
    sinks,
    scale,
    meta: StepView,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
    act_dtype: torch.dtype = torch.float32,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sink attention (as `layers.attention.sink_attention`, batched over the group's sequences) over each
    query's sliding window `swa` plus, if given, `extra` = (entries [G, n, D] shared by a sequence's
    queries, which of them each query sees): either a bool mask [G*Q, n] (every visible entry is scored)
    or a long top-k selection [G*Q, k] of entry indices, -1 = none (only the k selected entries are
    gathered and scored). Packed `q` [N, nh, D] -> FP64 [rows, nh, D] for `g.packed_rows`.

    Default path: query blocks of b slots score only the b + W - 1 band columns they can see, plus the
    entries (or their selection). Invisible keys got exactly zero probability before, so each row's
    softmax and weighted sum hold the same nonzero terms as a score over every key (summed in another
    order: FP64 rounding only).

    Batch-invariant mode: `batch_invariant.sink_attention` over the window's aligned key tiles and, for a
    bool `extra`, the entry tiles; a top-k `extra` becomes each query slot's own keys (`own_entries`), or
    `own` (keys [G*Q, Ko, D], visible bool [G*Q, Ko], from `invariant_selection`) gives them directly
    (with or without a bool `extra`: `invariant_selection` lays short contexts out as entry tiles).

    Native mode: FP32 [rows, nh, D]; the score and P.V products take `attention_operands(act_dtype)`
    operands (BF16 for BF16 activations: q and the keys already hold BF16 values, P is rounded to BF16)
    with FP32 accumulation, the softmax and sink stay FP32 (as `layers.attention.sink_attention`).
    """
    gq = g.rows.shape
    if extra is not None and extra[1].dtype != torch.bool and extra[1].dtype != torch.long:
        raise ValueError(
            f"attend: extra visibility must be a bool mask or long indices, got {extra[1].dtype}"
        )
    if own is not None and not batch_invariant.enabled():
        raise ValueError("attend: own keys are the batch-invariant layout of a top-k selection")
    if batch_invariant.enabled():  # keys laid out in aligned tiles by swa_keys / compressed_entries
        keys, visible = swa.keys, swa.visible
        if extra is not None and extra[1].dtype == torch.long:  # a top-k selection: each slot's own keys
            own, extra = own_entries(extra[0], extra[1], gq), None
        plan_source = None  # (a superset of `visible` the tile plan is built from, its cache id)
        if extra is not None:
            fp32 = batch_invariant.marked_fp32_valued(keys) and batch_invariant.marked_fp32_valued(extra[0])
            keys = torch.cat((keys, extra[0]), dim=1)
            if fp32:
                batch_invariant.mark_fp32_valued(keys)
            if len(extra) == 3:  # (entries, selected, selectable): plan from the selectable superset
                window_vis = visible
                plan_source = (lambda: torch.cat((window_vis, extra[2]), dim=1).view(*gq, -1), extra[2])
            visible = torch.cat((visible, extra[1]), dim=1)
        visible = visible.view(*gq, -1)
        plan = None
        all_tiles = False
        q_rows = q[g.rows]
        if batch_invariant.marked_fp32_valued(q):  # (rounded to FP32 / BF16: no test of every value)
            batch_invariant.mark_fp32_valued(q_rows)
        if gq[1] == 1 and batch_invariant.exact_scores_apply(q_rows, keys):
            pass  # decode: `sink_attention` takes its one-query path, which needs no tile plan
        elif meta.graph_safe:
            # the graph-safe step plans nothing on the host: every tile product is computed (the
            # skipped ones of a plan are exact +0 partials, so the bits are the eager step's)
            all_tiles = True
        else:
            # which key tiles each row tile sees: the same for every layer with this window and these
            # entries, so planned once per step (the entry mask is kept in the entry, so its id is not
            # reused by another tensor while the entry lives)
            if plan_source is not None:
                make_vis, held_by = plan_source
            else:
                make_vis, held_by = (lambda: visible), (None if extra is None else extra[1])
            held, plan = meta.cached(
                ("bi_plan", *swa.index_key, None if held_by is None else id(held_by), q.shape[1]),
                lambda: (held_by, batch_invariant.plan_attention(make_vis(), q.shape[1])),
            )
            if held is not held_by:
                plan = None
            elif plan_source is not None:
                plan = plan.for_visible(visible)
        if own is not None:
            own_keys = own[0].view(*gq, *own[0].shape[1:])
            if batch_invariant.marked_fp32_valued(own[0]):
                batch_invariant.mark_fp32_valued(own_keys)
            own = (own_keys, own[1].view(*gq, -1))
        out = batch_invariant.sink_attention(
            q_rows, keys, visible, sinks, scale, plan=plan, all_tiles=all_tiles, own=own
        )
        return g.real(out.reshape(-1, *out.shape[2:]))
    if swa.visible is not None:
        raise ValueError("attend: window keys in the batch-invariant layout outside batch-invariant mode")
    kernel = _listed_kernel(q, swa, meta, extra, act_dtype)
    if kernel is not None:
        return g.real(listed_attention(kernel, q, swa, g, sinks, scale, meta, extra))
    c = carrier()
    op = attention_operands(act_dtype)
    if native():  # operands converted once per call (CPU: BF16-rounded values held in FP32, `bmm_operand`)
        operand = lambda x: bmm_operand(x, op)  # noqa: E731
        scores_of = lambda x, m: _shared_keys(x, m.transpose(1, 2))  # noqa: E731  x [G,b,h,D], m [G,S,D]
        own_scores_of = lambda x, m: _own_keys(x, m.transpose(2, 3))  # noqa: E731  m [G,b,k,D]
        # P rounded to the operand dtype, as a BF16 attention kernel feeds its P.V product
        weigh = lambda p, m: _shared_keys(operand(p), m)  # noqa: E731
        own_weigh = lambda p, m: _own_keys(operand(p), m)  # noqa: E731
    else:
        operand = lambda x: x.to(c)  # noqa: E731
        scores_of = lambda x, m: torch.einsum("gqhd,gsd->gqhs", x, m)  # noqa: E731
        own_scores_of = lambda x, m: torch.einsum("gqhd,gqkd->gqhk", x, m)  # noqa: E731
        weigh = lambda p, m: torch.einsum("gqhs,gsd->gqhd", p, m)  # noqa: E731
        own_weigh = lambda p, m: torch.einsum("gqhk,gqkd->gqhd", p, m)  # noqa: E731
    keys = operand(swa.keys)
    w = swa.window
    entries = vis_e = sel = None
    n = 0
    n_heads, dim = q.shape[1], swa.keys.shape[2]
    per_row = n_heads * (2 * w - 1)  # band scores of one query row (blocks of >= W rows)
    if extra is not None:
        entries = operand(extra[0])
        if extra[1].dtype == torch.bool:
            vis_e = extra[1].view(*gq, 1, -1)
            n = entries.shape[1]
            per_row += n_heads * n
        else:  # a top-k selection: each row gathers its k entries (k * D values) and scores them
            sel = extra[1].view(*gq, -1)
            n = sel.shape[2]
            per_row += n * (n_heads + dim)
            g_idx = torch.arange(gq[0], device=sel.device)[:, None, None]
    # block rows: at least 2W (band overhead <= 1.5x) and BAND_BLOCK_ROWS, scores within SCORE_BLOCK_ELEMENTS
    block = min(gq[1], max(sizes.BAND_BLOCK_ROWS, 2 * w))
    block = max(1, min(block, sizes.SCORE_BLOCK_ELEMENTS // max(gq[0] * per_row, 1)))
    sink = sinks.to(c)[None, None, :, None]
    outs = []
    for a in range(0, gq[1], block):
        b = min(block, gq[1] - a)
        band = keys[:, a : a + b + w - 1]  # [G, b + W - 1, D], a view
        qs = operand(q[g.rows[:, a : a + b]])  # [G, b, nh, D]
        parts = [(scores_of(qs, band) * scale).masked_fill(~_band_mask(meta, g, swa, a, b), float("-inf"))]
        if vis_e is not None:
            parts.append((scores_of(qs, entries) * scale).masked_fill(~vis_e[:, a : a + b], float("-inf")))
        elif sel is not None:
            idx = sel[:, a : a + b]  # [G, b, k]
            picked = entries[g_idx, idx.clamp(min=0)]  # [G, b, k, D]; -1 re-reads entry 0, masked below
            parts.append(
                (own_scores_of(qs, picked) * scale).masked_fill((idx < 0)[:, :, None, :], float("-inf"))
            )
        parts.append(sink.expand(gq[0], b, -1, 1))
        logits = torch.cat(parts, dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)
        cb = band.shape[1]
        o = weigh(probs[..., :cb], band)
        if vis_e is not None:
            o = o + weigh(probs[..., cb : cb + n], entries)
        elif sel is not None:
            o = o + own_weigh(probs[..., cb : cb + n], picked)
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return g.real(out.reshape(-1, *out.shape[2:]))
