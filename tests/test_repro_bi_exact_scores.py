"""Batch-invariant mode's exact-product fast paths (`batch_invariant.row_scores`, the one-query attention in
`sink_attention`) against the tile computations they replace, bit for bit, and row by row against the batch
around them: a row alone equals the same row among 3, 8 or 37 others, with other key widths."""

from __future__ import annotations

import pytest
import torch
from deepinfer_model import batch_invariant as bi

KT = bi.KEY_TILE


def _fp32(*shape, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).float().double()


def test_row_scores_equal_the_tiled_scores(threads):
    gen = torch.Generator().manual_seed(1)
    for r in list(range(1, 20)) + [64, 130]:
        for s in (KT, 3 * KT, 8 * KT):
            q, k = _fp32(2, r, 128, scale=3.0, gen=gen), _fp32(2, s, 128, gen=gen)
            assert torch.equal(bi.row_scores(q, k), bi.tiled_scores(q, k)), (r, s)


def test_row_scores_row_does_not_depend_on_the_batch(threads):
    gen = torch.Generator().manual_seed(2)
    q, k = _fp32(1, 2, 128, gen=gen), _fp32(1, 2 * KT, 128, gen=gen)
    alone = bi.row_scores(q, k)[0]
    for m in (3, 8, 37):
        qs, ks = _fp32(m, 2, 128, gen=gen), _fp32(m, 5 * KT, 128, gen=gen)
        qs[m // 2], ks[m // 2] = q[0], 0.0
        ks[m // 2, : 2 * KT] = k[0]  # a wider neighbour: the row's keys padded with zero tiles
        assert torch.equal(bi.row_scores(qs, ks)[m // 2, :, : 2 * KT], alone), m


def test_exact_scores_need_marked_keys_and_fp32_queries():
    q, k = _fp32(1, 4, 64), _fp32(1, KT, 64)
    assert not bi.exact_scores_apply(q, k)  # unmarked keys: unknown bits
    bi.mark_fp32_valued(k)
    assert bi.exact_scores_apply(q, k)
    assert not bi.exact_scores_apply(q + 1e-12, k)  # more than FP32's 24 significant bits
    with pytest.raises(ValueError, match="KEY_TILE"):
        bi.row_scores(q, _fp32(1, KT + 1, 64))


def _decode_case(b, nh, tiles, gen):
    q = _fp32(b, 1, nh, 128, scale=0.5, gen=gen)
    keys = bi.mark_fp32_valued(_fp32(b, tiles * KT, 128, gen=gen))
    visible = torch.rand(b, 1, tiles * KT, generator=gen) < 0.6
    visible[:, :, -1] = False  # a trailing hidden column per sequence
    sinks = torch.randn(nh, generator=gen, dtype=torch.float64)
    return q, keys, visible, sinks


def test_half_pv_tile_rows_equal_the_full_tile(threads):
    """The kernel property the one-query P.V relies on for at most `PV_HALF_ROWS` heads: each row of a
    [4, KT] x [KT, D + 1] product (inexact products: exp values times FP32 keys) has the bits of the same
    row in the [8, KT] tile it is half of, whichever half, with zero or nonzero other rows, for any
    number of matrices per bmm call."""
    gen = torch.Generator().manual_seed(9)
    for n in (1, 3, 8, 37):
        for d in (64, 128):
            p = torch.exp(-20.0 * torch.rand(n, bi.TILE_ROWS, KT, generator=gen, dtype=torch.float64))
            p[torch.rand(n, bi.TILE_ROWS, KT, generator=gen) < 0.3] = 0.0  # hidden keys
            v = torch.cat((_fp32(n, KT, d, gen=gen), torch.ones(n, KT, 1, dtype=torch.float64)), dim=-1)
            full = torch.bmm(p, v)
            h = bi.PV_HALF_ROWS
            for lo in (0, h):
                half = torch.bmm(p[:, lo : lo + h].contiguous(), v)
                assert torch.equal(_bits(half), _bits(full[:, lo : lo + h])), (n, d, lo)
            zero_rest = p.clone()
            zero_rest[:, h:] = 0.0  # a decode tile: the heads' rows, then zero rows
            assert torch.equal(
                _bits(torch.bmm(p[:, :h].contiguous(), v)), _bits(torch.bmm(zero_rest, v)[:, :h])
            )


@pytest.mark.parametrize("nh", [2, 3, 4, 12])
def test_one_query_attention_is_the_tile_computation(nh, threads):
    gen = torch.Generator().manual_seed(3 + nh)
    for b, tiles in ((1, 1), (3, 2), (8, 5)):
        q, keys, visible, sinks = _decode_case(b, nh, tiles, gen)
        assert bi.exact_scores_apply(q, keys)
        ref = bi.sink_attention(q, keys, visible, sinks, 0.088, all_tiles=True)
        plan = bi.plan_attention(visible, nh)  # the path a plan would take, for the record
        assert torch.equal(bi.sink_attention(q, keys, visible, sinks, 0.088), ref)
        assert torch.equal(bi.sink_attention(q, keys, None, sinks, 0.088, plan=plan), ref)


def test_one_query_attention_row_does_not_depend_on_the_batch(threads):
    gen = torch.Generator().manual_seed(4)
    q, keys, visible, sinks = _decode_case(1, 4, 2, gen)
    alone = bi.sink_attention(q, keys, visible, sinks, 0.088)[0]
    for m in (3, 8, 37):
        qs, ks, vs, _ = _decode_case(m, 4, 4, gen)  # wider neighbours: the row gets two more hidden tiles
        i = m // 2
        qs[i], ks[i], vs[i] = q[0], 0.0, False
        ks[i, : 2 * KT], vs[i, :, : 2 * KT] = keys[0], visible[0]
        assert torch.equal(bi.sink_attention(qs, bi.mark_fp32_valued(ks), vs, sinks, 0.088)[i], alone), m


def _chunk_case(b, m, nh, tiles, gen, window=None):
    """M queries per key set: a random visibility, or (`window`) a sliding-window band over the keys."""
    q = _fp32(b, m, nh, 128, scale=0.5, gen=gen)
    keys = bi.mark_fp32_valued(_fp32(b, tiles * KT, 128, gen=gen))
    if window is None:
        visible = torch.rand(b, m, tiles * KT, generator=gen) < 0.5
    else:
        pos = torch.arange(tiles * KT)[None, :]
        q_pos = torch.arange(m)[:, None] + (tiles * KT - m)  # the chunk's queries end at the last key
        visible = ((pos <= q_pos) & (pos > q_pos - window)).expand(b, -1, -1).clone()
    sinks = torch.randn(nh, generator=gen, dtype=torch.float64)
    return q, keys, visible, sinks


def _bits(x):
    return x.contiguous().view(torch.int64)


@pytest.mark.parametrize(
    ("m", "nh", "tiles", "window"),
    [(2, 4, 1, None), (5, 3, 3, None), (64, 4, 4, None), (20, 12, 3, None), (150, 4, 8, 20), (130, 3, 9, 40)],
)
def test_exact_attention_is_the_tile_computation(m, nh, tiles, window, threads):
    """The exact-score path for chunks of M > 1 queries (`_exact_attention_blocks`: row_scores, the P.V
    tiles over the row tiles that see each key tile, query blocks against their band of key tiles) is
    bitwise the full tile computation, with and without a plan, dense and band-sparse."""
    gen = torch.Generator().manual_seed(5 + m)
    for b in (1, 3):
        q, keys, visible, sinks = _chunk_case(b, m, nh, tiles, gen, window)
        assert bi.exact_scores_apply(q, keys)
        ref = bi.sink_attention(q, keys, visible, sinks, 0.088, all_tiles=True)
        assert torch.equal(_bits(bi.sink_attention(q, keys, visible, sinks, 0.088)), _bits(ref))
        plan = bi.plan_attention(visible, nh)
        assert torch.equal(_bits(bi.sink_attention(q, keys, None, sinks, 0.088, plan=plan)), _bits(ref))
        if window is not None:  # several query blocks, each against its own key tiles
            assert m > bi.EXACT_BLOCK_QUERIES and not plan.dense


def test_exact_attention_row_does_not_depend_on_the_batch_or_the_chunking(threads):
    """A sequence's chunk alone equals the same chunk among M = 3, 8, 37 other sequences with wider key
    sets; and a chunk of 72 queries (two query blocks) equals its queries computed as chunks of 40 + 32 and,
    for every third query, one at a time (the decode path), each seeing the same keys."""
    gen = torch.Generator().manual_seed(6)
    q, keys, visible, sinks = _chunk_case(1, 72, 4, 4, gen, window=24)
    alone = bi.sink_attention(q, keys, visible, sinks, 0.088)[0]
    for m in (3, 8, 37):
        qs, ks, vs, _ = _chunk_case(m, 72, 4, 6, gen)  # wider neighbours: two more hidden key tiles
        i = m // 2
        qs[i], ks[i], vs[i] = q[0], 0.0, False
        ks[i, : 4 * KT], vs[i, :, : 4 * KT] = keys[0], visible[0]
        got = bi.sink_attention(qs, bi.mark_fp32_valued(ks), vs, sinks, 0.088)[i]
        assert torch.equal(_bits(got), _bits(alone)), m
    parts = [
        bi.sink_attention(q[:, a:z], keys, visible[:, a:z], sinks, 0.088) for a, z in ((0, 40), (40, 72))
    ]
    assert torch.equal(_bits(torch.cat(parts, dim=1)[0]), _bits(alone))
    for j in range(0, 72, 3):
        one = bi.sink_attention(q[:, j : j + 1], keys, visible[:, j : j + 1], sinks, 0.088)[0, 0]
        assert torch.equal(_bits(one), _bits(alone[j])), j


def test_grouped_output_projection_rows_do_not_depend_on_the_batch(monkeypatch):
    """The attention's grouped output projection in the mode (`project_output`: every group in one
    `grouped_gemm` call) gives a token's row the same bits alone and among 3, 8 and 37 other tokens,
    the same bits as one row-invariant GEMM per group (the path it replaces), and equals the float64
    einsum to FP32 rounding."""
    from deepinfer_model.layers.attention import AttentionWeights, project_output
    from deepinfer_model.numerics import round_to

    monkeypatch.setenv(bi.ENV, "1")
    gen = torch.Generator().manual_seed(7)
    nh, d, groups, ro, hidden = 4, 64, 2, 32, 96
    w = AttentionWeights.__new__(AttentionWeights)
    w.wo_a = torch.randn(groups * ro, nh * d // groups, generator=gen)
    w.wo_b = torch.randn(hidden, groups * ro, generator=gen)
    assert bi.stacked_parts(w.wo_a, groups=groups) is not None  # the one-call path is taken

    def run(o):  # an identity RoPE on the last 16 channels (cos 1, sin 0: exact)
        t = o.shape[0]
        return project_output(
            o, w, groups, torch.ones(t, 8, dtype=torch.float64), torch.zeros(t, 8, dtype=torch.float64)
        )

    o = torch.randn(1, nh, d, generator=gen, dtype=torch.float64)
    alone = run(o)
    for m in (3, 8, 37):
        others = torch.randn(m, nh, d, generator=gen, dtype=torch.float64)
        others[m // 2] = o[0]
        got = run(others)
        assert torch.equal(_bits(got[m // 2]), _bits(alone[0])), m
        with monkeypatch.context() as mp:  # the per-group path: the same bits
            mp.setattr(bi, "stacked_parts", lambda *a, **k: None)
            assert torch.equal(_bits(run(others)), _bits(got)), m
    z = torch.einsum(
        "tgi,gri->tgr",
        round_to(o, torch.float32).reshape(1, groups, -1),
        w.wo_a.double().view(groups, ro, -1),
    )
    ref = round_to(z, torch.float32).reshape(1, -1) @ w.wo_b.double().t()
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)


def test_fp32_marks_follow_in_place_changes():
    """A mark (`mark_fp32_valued`) holds only until the tensor (or a view of it) is changed in place, and
    derived tensors are not marked; `numerics.round_to` marks its result in the mode only."""
    from deepinfer_model.numerics import round_to

    x = bi.mark_fp32_valued(_fp32(4, 8))
    assert bi.marked_fp32_valued(x) and not bi.marked_fp32_valued(x * 1.0)
    x[:, 0].add_(1e-12)  # through a view: now more than 24 significant bits
    assert not bi.marked_fp32_valued(x)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(bi.ENV, "1")
        assert bi.marked_fp32_valued(round_to(torch.randn(3, dtype=torch.float64), torch.float32))
        mp.setenv(bi.ENV, "0")
        assert not bi.marked_fp32_valued(round_to(torch.randn(3, dtype=torch.float64), torch.float32))


@pytest.mark.parametrize("threads_", [1, 2])
def test_grouped_gemm_known_fp32_rows_are_the_tested_path(threads_):
    """`grouped_gemm(..., fp32_valued=True)` (rows known to be FP32-valued: no hi/lo split; equal groups
    as one bmm of the rows as they are) gives the bits of the path that tests every row, for equal and
    unequal groups, padded and per-group; and a row alone equals the same row among 3, 8, 37 others."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads_)
    try:
        gen = torch.Generator().manual_seed(8)
        for e, k, n in ((2, 256, 32), (5, 128, 64)):
            parts = bi.stacked_parts(torch.randn(e, n, k, generator=gen))
            for counts in ([7] * e, [3, 0, 9, 1, 4][:e] if e == 5 else [1, 40]):
                x = _fp32(sum(counts), k, gen=gen)
                ref = bi.grouped_gemm(x, counts, parts)
                for loop in (None, False, True):
                    got = bi.grouped_gemm(x, counts, parts, loop=loop, fp32_valued=True)
                    assert torch.equal(_bits(got), _bits(ref)), (e, counts, loop)
            row = _fp32(1, k, gen=gen)
            alone = bi.grouped_gemm(row, [1] + [0] * (e - 1), parts, fp32_valued=True)[0]
            for m in (3, 8, 37):
                xs = _fp32(m * e, k, gen=gen)
                xs[m // 2] = row[0]  # group 0, row m // 2 (m rows per group)
                got = bi.grouped_gemm(xs, [m] * e, parts, fp32_valued=True)[m // 2]
                assert torch.equal(_bits(got), _bits(alone)), (e, m)
    finally:
        torch.set_num_threads(before)
