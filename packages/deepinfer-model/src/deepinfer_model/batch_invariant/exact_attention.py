"""`sink_attention` bit for bit for FP32-valued q and keys on the CPU (`exact_scores_apply`): the scores
from one exact GEMM (`row_scores`) instead of per-tile products, no plan; one query per key set (decode)
or blocks of queries against the key tiles they see (prefill chunks, verification)."""

from __future__ import annotations

import numpy as np
import torch

from .attention_plan import _seen_from_queries
from .fixed_bmm import TILE_ROWS, bmm
from .fp32_values import mark_fp32_valued
from .key_layout import KEY_TILE
from .own_keys import _own_max, _own_partials, _own_scores, _with_own
from .scores import row_scores

EXACT_BLOCK_QUERIES = 64  # queries per block of `_exact_attention_blocks` (each scores its band of key tiles)
PV_HALF_ROWS = 4  # `_one_query_attention`: P.V tile rows for at most this many heads (CPU, see there)


def _masked_exp(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`exp(x)` for `x` that is -inf exactly where `visible` (a 0/1 FP64 tensor, broadcast against `x`) is 0,
    bit for bit `torch.exp(x)` for finite visible entries: the -inf entries take exp(0) and are multiplied by
    0, the visible ones by 1 (exact; NaN stays NaN). Why not `torch.exp(x)`: on the AVX-512 host the exp of
    an argument out of its range (-inf included) ran several times slower than of one in range (measured:
    [8, 128, 256] FP64 with 88% of it -inf, 1.8 vs 0.2 ms), and most of a prefill chunk's scores are masked.
    (Only a visible -inf, from an infinite key, would differ: exp(0) = 1 instead of 0.)"""
    return torch.exp(x.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0)).mul_(visible)


def _one_query_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`sink_attention` bit for bit for one query per key set (decode), q [B, 1, nh, D] and keys [B, S, D]
    FP32-valued (`exact_scores_apply`), without the tile plan's padding, gathers and per-tile calls:

    - scores: `row_scores` (one NN bmm, keys as rows; the same bits as the tiled score products);
    - scale, mask, max, exp as in `_sink_attention_full`, on [B, S, nh] (S a multiple of `KEY_TILE`, so
      every exp runs in whole SIMD vectors, as there);
    - P.[K | 1]: the same fixed [TILE_ROWS, KEY_TILE] x [KEY_TILE, D + 1] products of contiguous tiles
      (head h is row h % TILE_ROWS of row tile h // TILE_ROWS, as `_row_tiles` lays out a query's heads;
      the other rows zero; with at most `PV_HALF_ROWS` heads, tiles of that many rows, whose rows have
      the same bits), all in one bmm, and the tile partials added in tile order from +0 (cumsum).
    Tested against `_sink_attention_full` (`test_one_query_attention_is_the_tile_computation`)."""
    bsz, _, nh, d = q.shape
    s = keys.shape[1]
    n_tiles = s // KEY_TILE
    rt = -(-nh // TILE_ROWS)
    sc = row_scores(q.reshape(bsz, nh, d), keys).transpose(1, 2) * scale  # [B, S, nh], contiguous
    vis = visible.reshape(bsz, s, 1)
    sc = sc.masked_fill_(~vis, float("-inf"))
    sink = sinks.to(q.device, torch.float64)
    own_sc = None if own is None else _own_scores(q, own, scale)  # [B, 1, nh, Ko]
    mx = _own_max(torch.maximum(sc.amax(dim=1), sink)[:, None], own_sc)[:, 0]  # [B, nh] (max: exact)
    e = _masked_exp(sc - mx[:, None, :], vis.double())  # [B, S, nh]
    # the sink's exp in a whole tile per sequence (columns past nh: exp(0), unused; not -inf, whose exp is
    # slow, see `_masked_exp`)
    width = rt * TILE_ROWS * KEY_TILE
    sk = q.new_zeros((bsz, width), dtype=torch.float64)
    sk[:, :nh] = sink - mx
    e_sink = torch.exp(sk)[:, :nh]
    # P tiles [B, T, Rt * rows, KT]: row h = head h, padding rows zero. With at most `PV_HALF_ROWS` heads
    # the tiles have that many rows instead of TILE_ROWS: the rows of a [4, KT] x [KT, D + 1] product
    # have the bits of the same rows of the [8, KT] tile (MKL computes a row of a full 4-row register
    # block the same way; measured, and tested: `test_half_pv_tile_rows_equal_the_full_tile`), and a
    # 4-head decode row would otherwise multiply 4 zero rows per tile
    rows = PV_HALF_ROWS if nh <= PV_HALF_ROWS else TILE_ROWS
    rt_pv = -(-nh // rows)
    ev = e.view(bsz, n_tiles, KEY_TILE, nh).transpose(2, 3)
    if rt_pv * rows == nh:
        pt = ev.contiguous()
    else:
        pt = e.new_zeros(bsz, n_tiles, rt_pv * rows, KEY_TILE)
        pt[:, :, :nh] = ev
    vals = torch.cat((keys, keys.new_ones(bsz, s, 1)), dim=-1).view(bsz, n_tiles, 1, KEY_TILE, d + 1)
    if rt_pv > 1:
        vals = vals.expand(-1, -1, rt_pv, -1, -1)
    vals = vals.reshape(-1, KEY_TILE, d + 1)
    part = bmm(pt.view(-1, rows, KEY_TILE), vals).view(bsz, n_tiles, rt_pv * rows, d + 1)
    if q.device.type == "cpu":  # a sequential sum from +0 in tile order (see `sink_attention`)
        acc = torch.cumsum(part, dim=1)[:, -1, :nh]
    else:
        acc = part[:, 0, :nh]
        for t in range(1, n_tiles):
            acc = acc + part[:, t, :nh]
    if own is not None:
        acc = _with_own(acc[:, None], _own_partials(own_sc, mx[:, None], own))[:, 0]
    den = acc[..., d] + e_sink
    return (acc[..., :d] / den[..., None]).view(bsz, 1, nh, d)


def _exact_attention_blocks(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    seen: np.ndarray | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`sink_attention` bit for bit for M queries per key set (prefill chunks, verification blocks) with
    FP32-valued q and keys (`exact_scores_apply`): `_exact_attention` on blocks of queries, each against
    the whole key tiles some row of the block sees (the sliding-window band: a block of b queries scores
    about b + window keys, not the whole chunk). Tiles a block does not see contribute exactly what they
    contribute in the full computation: -inf scores (no effect on the max), exp 0, and a P.V partial of
    +0 that the tile-order sum adds as x + 0 = x; so starting the sum at the block's first seen tile
    changes no bit (see `sink_attention`). Blocks start at query boundaries that are also row-tile
    boundaries (m0 * nh a multiple of `TILE_ROWS`), so every P tile holds the same rows as in the full
    layout. `seen` (bool [B, Rt, T], optional): which (row tile, key tile) pairs some row sees."""
    bsz, m, nh, _ = q.shape
    n_tiles = keys.shape[1] // KEY_TILE
    rt = -(-(m * nh) // TILE_ROWS)
    if seen is None:
        seen = _seen_from_queries(visible.view(bsz, m, n_tiles, KEY_TILE).any(dim=-1).cpu().numpy(), nh, rt)
    align = TILE_ROWS // np.gcd(nh, TILE_ROWS)  # queries per block: a multiple of this
    block = max(align, (EXACT_BLOCK_QUERIES // align) * align)
    if block >= m:
        return _exact_attention(q, keys, visible, sinks, scale, seen, own)
    out = []
    for m0 in range(0, m, block):
        m1 = min(m, m0 + block)
        r0, r1 = m0 * nh // TILE_ROWS, -(-(m1 * nh) // TILE_ROWS)
        cols = np.flatnonzero(seen[:, r0:r1].any(axis=(0, 1)))
        if not len(cols):  # no row of the block sees a key: the sink alone (one tile of hidden keys)
            cols = np.zeros(1, dtype=np.int64)
        k0, k1 = int(cols[0]), int(cols[-1]) + 1
        c0, c1 = k0 * KEY_TILE, k1 * KEY_TILE
        out.append(
            _exact_attention(
                q[:, m0:m1],
                mark_fp32_valued(keys[:, c0:c1]),
                visible[:, m0:m1, c0:c1],
                sinks,
                scale,
                seen[:, r0:r1, k0:k1],
                None if own is None else (own[0][:, m0:m1], own[1][:, m0:m1]),
            )
        )
    return torch.cat(out, dim=1)


def _exact_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    seen: np.ndarray | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`_sink_attention_full` bit for bit for FP32-valued q [B, M, nh, D] and keys [B, S, D]
    (`exact_scores_apply`), with the scores from `row_scores` (one NN bmm, keys as rows; the same bits as
    the tiled score products) instead of the per-tile score GEMMs:

    - scale, mask, max and exp element by element on [B, S, M * nh] (contiguous, S a multiple of
      `KEY_TILE`: every exp runs in whole SIMD vectors, as there); the sink's exp in whole tiles too;
    - P.[K | 1]: the same fixed [TILE_ROWS, KEY_TILE] x [KEY_TILE, D + 1] products of contiguous P tiles
      (row j of row tile r = row r * 8 + j of the M * nh (query, head) rows, as `_row_tiles` lays them
      out), one bmm per (sequence, key tile) over the row tiles that see it (`seen`: the hull of them;
      the rest stay the +0 the full computation gets), and the tile partials added in tile order.
    Tested against `_sink_attention_full` (`test_exact_attention_is_the_tile_computation`)."""
    bsz, m, nh, d = q.shape
    s = keys.shape[1]
    n_tiles = s // KEY_TILE
    r = m * nh
    rt = -(-r // TILE_ROWS)
    sc = row_scores(q.reshape(bsz, r, d), keys).transpose(1, 2) * scale  # [B, S, R], contiguous
    vis = visible.transpose(1, 2).contiguous()[..., None]  # [B, S, M, 1]
    sc = sc.view(bsz, s, m, nh).masked_fill_(~vis, float("-inf")).view(bsz, s, r)
    sink = sinks.to(q.device, torch.float64)
    own_sc = None if own is None else _own_scores(q, own, scale)
    row_mx = _own_max(torch.maximum(sc.amax(dim=1).view(bsz, m, nh), sink), own_sc)  # (max: exact)
    mx = row_mx.view(bsz, 1, r)
    e = _masked_exp((sc - mx).view(bsz, s, m, nh), vis.double()).view(bsz, s, r)  # [B, S, R]
    # the sinks' exps in whole tiles (numel a multiple of KEY_TILE)
    n_sk = bsz * r
    sk = q.new_zeros(n_sk + (-n_sk) % KEY_TILE, dtype=torch.float64)
    sk[:n_sk] = (sink - mx.view(bsz, m, nh)).reshape(-1)
    e_sink = torch.exp(sk)[:n_sk].view(bsz, m, nh)
    # P tiles [B, T, Rt, 8, KT] (contiguous), zero rows past R
    ep = e if rt * TILE_ROWS == r else torch.cat((e, e.new_zeros(bsz, s, rt * TILE_ROWS - r)), dim=2)
    pt = ep.view(bsz, n_tiles, KEY_TILE, rt, TILE_ROWS).permute(0, 1, 3, 4, 2).contiguous()
    vals = torch.cat((keys, keys.new_ones(bsz, s, 1)), dim=-1).view(bsz, n_tiles, KEY_TILE, d + 1)
    if rt == 1:  # one row tile per key tile: every product in one call, partials added in tile order
        part = bmm(pt.view(-1, TILE_ROWS, KEY_TILE), vals.view(-1, KEY_TILE, d + 1))
        part = part.view(bsz, n_tiles, TILE_ROWS, d + 1)
        acc = part[:, 0]
        for t in range(1, n_tiles):
            acc = acc + part[:, t]
    else:
        # each (sequence, key tile): the hull [lo, hi) of the row tiles that see it, from the host mask
        if seen is None:
            lo, hi = np.zeros((bsz, n_tiles), dtype=np.int64), np.full((bsz, n_tiles), rt)
        else:
            any_row = seen.any(axis=1)  # [B, T]
            lo = np.where(any_row, seen.argmax(axis=1), 0)
            hi = np.where(any_row, rt - seen[:, ::-1].argmax(axis=1), 0)
        # the partials of a row tile added in key tile order; a row tile outside a key tile's hull gets
        # the +0 the full computation adds there (x + 0 = x), so it is skipped
        acc = pt.new_zeros(bsz, rt, TILE_ROWS, d + 1)
        for t in range(n_tiles):
            for b in range(bsz):
                r0, r1 = int(lo[b, t]), int(hi[b, t])
                if r1 > r0:
                    acc[b, r0:r1] += torch.bmm(pt[b, t, r0:r1], vals[b, t].expand(r1 - r0, -1, -1))
    acc = acc.reshape(bsz, rt * TILE_ROWS, d + 1)[:, :r].view(bsz, m, nh, d + 1)
    if own is not None:
        acc = _with_own(acc, _own_partials(own_sc, row_mx, own))
    den = acc[..., d] + e_sink
    return acc[..., :d] / den[..., None]
