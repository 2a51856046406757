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


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


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


@pytest.mark.parametrize("nh", [4, 12])
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
