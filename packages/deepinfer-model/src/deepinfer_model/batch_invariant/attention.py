"""Sink attention (K = V) whose reduction order does not depend on the batch (`sink_attention`).

Why: the paged runtime attends per padded group of sequences, so the default path's FP64 score / softmax /
P·V sums see a key count, a column offset and a GEMM shape that depend on the group (measured: a decode
row's FP64 output changed in 261 of 270 group compositions). In the mode, keys are laid out in tiles of
`KEY_TILE` columns aligned to a frame that depends only on the key itself (absolute position for
sliding-window keys, entry index for compressed entries), and every product is a fixed-shape GEMM
([TILE_ROWS, D] x [D, KEY_TILE] for scores, [TILE_ROWS, KEY_TILE] x [KEY_TILE, D + 1] for the unnormalised
P·V and its row sum). Tile partials are added in tile order, one tile at a time; a tile a query cannot see
contributes exact zeros, so extra padding tiles, in front (another chunk start) or behind (a wider
neighbour), change nothing. Products of a row tile and a key tile that no row of it sees are not computed at
all (`AttentionPlan`, built once per step and key set): the sliding-window band; where at most
`DENSE_FRACTION` of the tiles are seen, the mask / max / exp and P.V also run on the seen tiles only
(gathered); both are bitwise the full computation (tested). The sink is added last. With FP32-valued q and
keys on the CPU (`exact_scores_apply`: keys read from an FP32 or narrower pool, queries rounded) the scores
come from `row_scores` (every product exact, so one keys-as-rows GEMM gives the tile bits) and no plan is
needed: `_one_query_attention` for decode, `_exact_attention_blocks` for chunks (query blocks against the
key tiles they see, P.V on the same fixed tiles); both bitwise the tile path. Operands are made contiguous
first: the GEMM kernel (and its rounding) depends on their layout too (a transposed view that `reshape`
copied for one batch size but not another did change results). The exp runs on whole tiles (SIMD and
scalar-tail exp differ in the last bit). A sparse layer's top-k selected compressed entries: for a query
that sees at most `SHARED_ENTRY_COLS` entries, columns of its sequence's first entry tiles (shared by the
chunk's queries: one read); for a longer context, the query's own keys, in ascending entry order padded to
`own_layout` (`own_order`): scored per query, in the same softmax as the shared tiles, their P.V partials
added after the shared tiles' one own tile at a time (as shared columns a long-context decode query would
score every entry tile, since its selections spread over nearly all of them). Which layout a query takes
depends on its own position only, and its own list on its selected set only, so neither depends on its
neighbours (`models.grouped_attention.invariant_selection`).
"""

from __future__ import annotations

import numpy as np
import torch

from .attention_plan import AttentionPlan, _plan_products
from .exact_attention import _exact_attention_blocks, _one_query_attention
from .fixed_bmm import TILE_ROWS
from .key_layout import KEY_TILE
from .own_keys import _own_max, _own_partials, _own_scores, _with_own
from .scores import exact_scores_apply, tiled_scores
from .tile_products import _row_tiles, _tile_products


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    all_tiles: bool = False,
    plan: AttentionPlan | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sink attention (K = V) with a batch-independent reduction order; FP64 [B, M, nh, D].

    q [B, M, nh, D] (M queries sharing key set b), keys [B, S, D] with S a multiple of `KEY_TILE` laid
    out in aligned tiles (`aligned_span`, `key_tiles`), visible [B, M, S] bool (or its `plan`), sinks
    [nh]. A query's result depends only on its own q, its visible keys and their tile columns.

    Only the (row tile, key tile) pairs some row of the row tile sees are computed (`AttentionPlan`):
    their score products, mask, exp and P.V products, each on whole tiles, gathered into one list of
    tiles. The others are exactly what the full computation (`all_tiles=True`, `_sink_attention_full`,
    kept as the reference the tests compare with bit for bit) gets for them: scores masked to -inf, so
    they do not change a row's max, exp 0, and a P.V partial of +0 (an all-zero P tile: the GEMM sums
    products of +0 from a +0 accumulator; measured), which leaves the tile-order sum unchanged wherever
    it is added (x + 0 = x for every x but -0, and no partial is ever -0 for the same reason).

    `own` (optional): each query's own keys after the shared ones, (keys [B, M, Ko, D], visible bool
    [B, M, Ko]) with Ko from `own_layout` (the top-k selected compressed entries in `own_order`): scored
    per query (`_own_scores`), in the softmax with the shared keys, and their P.V partials per own tile
    added after the shared tiles' (`_own_partials`, `_with_own`). Why not the selected entries as columns
    of shared entry tiles: a decode query then scores every entry tile (nearly all are seen), 10x the
    keys the selection holds.
    """
    if all_tiles:
        return _sink_attention_full(q, keys, visible, sinks, scale, own=own)
    bsz, m, nh, d = q.shape
    if exact_scores_apply(q, keys):  # (own scores take the same products on every path)
        vis = visible if visible is not None else plan.visible
        if m == 1:  # decode: one query per key set
            return _one_query_attention(q, keys, vis, sinks, scale, own)
        seen = plan.seen if plan is not None else None
        return _exact_attention_blocks(q, keys, vis, sinks, scale, seen, own)
    if plan is None:
        plan = AttentionPlan(visible, nh)
    if plan.shape[:3] != (bsz, m, nh) or plan.shape[3] * KEY_TILE != keys.shape[1]:
        raise ValueError(
            f"attention plan for {plan.shape} does not fit q {tuple(q.shape)}, keys {tuple(keys.shape)}"
        )
    if plan.dense:
        return _sink_attention_full(q, keys, plan.visible, sinks, scale, plan.seen, own)
    n_tiles, rt = plan.shape[3:]
    dev = q.device
    # score products of the seen tiles only
    qt = _row_tiles(q.reshape(bsz, m * nh, d).double()).reshape(bsz * rt, TILE_ROWS, d)
    kd = keys.double().reshape(bsz * n_tiles, KEY_TILE, d)
    kt = kd.transpose(-1, -2).contiguous()  # [B*T, D, KT]: contiguous transposed key tiles
    scores = _plan_products(plan, qt, plan.row_tile, kt) * scale  # [N, 8, KT]
    scores = scores.masked_fill(plan.hidden, float("-inf"))
    # the sink as column 0 of one more tile per row (whole-tile exp, as for the scores); padding rows
    # get sink 0 so that their max is finite and all their exps 0
    sink_val = torch.where(plan.real, sinks.to(dev, torch.float64)[plan.heads], 0.0)
    sink = q.new_full((bsz * rt * TILE_ROWS, KEY_TILE), float("-inf"), dtype=torch.float64)
    sink[:, 0] = sink_val.repeat(bsz)
    # each row's max: over its seen tiles and the sink (max is exact: any grouping gives the same value)
    tile_mx = torch.cat((scores.amax(dim=-1), scores.new_full((1, TILE_ROWS), float("-inf"))))
    mx = torch.maximum(tile_mx[plan.order].amax(dim=1), sink[:, 0].view(bsz * rt, TILE_ROWS))
    own_sc = None
    if own is not None:  # the own keys' max per (query, head) row, in the row tile layout
        own_sc = _own_scores(q, own, scale)
        own_mx = q.new_full((bsz, rt * TILE_ROWS), float("-inf"), dtype=torch.float64)
        own_mx[:, : m * nh] = own_sc.amax(dim=-1).view(bsz, m * nh)
        mx = torch.maximum(mx, own_mx.view(bsz * rt, TILE_ROWS))
    e = torch.exp(scores - mx[plan.row_tile][:, :, None])  # [N, 8, KT]
    e_sink = torch.exp(sink - mx.view(-1, 1))[:, 0]  # [B*Rt*8]
    # unnormalised P.[K | 1] of the seen tiles: value sums and softmax denominator from one fixed GEMM
    vals = torch.cat((kd, kd.new_ones(bsz * n_tiles, KEY_TILE, 1)), dim=-1)  # [B*T, KT, D+1]
    part = _plan_products(plan, e, torch.arange(plan.n_sel, device=dev), vals)  # [N, 8, D+1]
    # partials of a row tile in key tile order (`order`), the missing slots the +0 of an unseen tile
    part = torch.cat((part, part.new_zeros(1, TILE_ROWS, d + 1)))[plan.order]
    if dev.type == "cpu":
        # the CPU cumsum is a sequential sum from +0 in index order (one pass): the same additions as
        # the loop below, in one call instead of k_max
        acc = torch.cumsum(part, dim=1)[:, -1]
    else:  # (a GPU cumsum is a parallel scan: another order)
        acc = part[:, 0]
        for k in range(1, plan.k_max):
            acc = acc + part[:, k]
    acc = acc.reshape(bsz, rt * TILE_ROWS, d + 1)[:, : m * nh].reshape(bsz, m, nh, d + 1)
    if own is not None:
        row_mx = mx.view(bsz, rt * TILE_ROWS)[:, : m * nh].reshape(bsz, m, nh)
        acc = _with_own(acc, _own_partials(own_sc, row_mx, own))
    den = acc[..., d] + e_sink.reshape(bsz, rt * TILE_ROWS)[:, : m * nh].reshape(bsz, m, nh)
    return acc[..., :d] / den[..., None]


def _sink_attention_full(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    seen: np.ndarray | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`sink_attention` with the mask / exp / max over every key column and every (row tile, key tile)
    product, or (`seen`, bool [B, Rt, T]) only the products of seen pairs (the others stay the +0 they
    would be). With `seen` None: the reference the tile skipping must match bit for bit (tests)."""
    bsz, m, nh, d = q.shape
    s = keys.shape[1]
    if s % KEY_TILE:
        raise ValueError(f"keys.shape[1] = {s} must be a multiple of KEY_TILE = {KEY_TILE}")
    scores = tiled_scores(q.reshape(bsz, m * nh, d), keys, seen).view(bsz, m, nh, s) * scale
    n_tiles = s // KEY_TILE
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    # the sink as column 0 of one more tile: every exp below runs on whole tiles (no scalar tail)
    sink = scores.new_full((bsz, m, nh, KEY_TILE), float("-inf"))
    sink[..., 0] = sinks.to(sink.device, torch.float64)[None, None, :]
    logits = torch.cat((scores, sink), dim=-1)
    own_sc = None if own is None else _own_scores(q, own, scale)
    mx = _own_max(logits.amax(dim=-1), own_sc)  # [B, M, nh]
    e = torch.exp(logits - mx[..., None])
    # unnormalised P·[K | 1]: the value sums and the softmax denominator from the same fixed GEMM
    kd = keys.double().view(bsz, n_tiles, KEY_TILE, d)
    vals = torch.cat((kd, kd.new_ones(bsz, n_tiles, KEY_TILE, 1)), dim=-1)  # [B, St, KT, D+1]
    pt = _row_tiles(e[..., :s].reshape(bsz, m * nh, s))  # [B, Rt, 8, S]
    rt = pt.shape[1]
    pt = (
        pt.view(bsz, rt, TILE_ROWS, n_tiles, KEY_TILE).permute(0, 1, 3, 2, 4).contiguous()
    )  # [B, Rt, St, 8, KT]
    part = _tile_products(pt, vals, seen)  # [B, Rt, St, 8, D+1]
    acc = part[:, :, 0]
    for t in range(1, n_tiles):  # tile order, one tile at a time: padding tiles add exact zeros
        acc = acc + part[:, :, t]
    acc = acc.reshape(bsz, -1, d + 1)[:, : m * nh].view(bsz, m, nh, d + 1)
    if own is not None:
        acc = _with_own(acc, _own_partials(own_sc, mx, own))
    den = acc[..., d] + e[..., s]
    return acc[..., :d] / den[..., None]
