"""Batch-invariant attention with each query's own keys (its top-k selected compressed entries, scored per
query after the shared sliding-window tiles; `batch_invariant.sink_attention(..., own=...)`): every path
(the full tile computation, the tile plan, the exact-score chunk and decode paths) gives the same bits,
a query's row does not depend on the batch, the chunking or the order the selection listed its entries,
and the result is the FP64 softmax attention it stands for (a naive reference)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_model import batch_invariant as bi

KT = bi.KEY_TILE


def _fp32(*shape, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).float().double()


def _bits(x):
    return x.contiguous().view(torch.int64)


def _case(b, m, nh, tiles, topk, gen, window=12):
    """A group as the paged runtime lays it out: per sequence a sliding-window band over `tiles` shared key
    tiles (queries at the last positions), and per query `topk` selected entries (some -1) as own keys."""
    q = _fp32(b, m, nh, 128, scale=0.5, gen=gen)
    keys = bi.mark_fp32_valued(_fp32(b, tiles * KT, 128, gen=gen))
    pos = torch.arange(tiles * KT)[None, :]
    q_pos = torch.arange(m)[:, None] + (tiles * KT - m)
    visible = ((pos <= q_pos) & (pos > q_pos - window)).expand(b, -1, -1).clone()
    n_entries = 3 * topk
    scores = torch.rand(b * m, n_entries, generator=gen)
    selected = torch.topk(scores, topk, dim=-1).indices  # descending score: not ascending entry order
    selected[torch.rand(b * m, topk, generator=gen) < 0.25] = -1
    order = bi.own_order(selected)
    entries = _fp32(b, n_entries, 128, gen=gen)
    seq = torch.arange(b).repeat_interleave(m)[:, None]
    own_keys = entries[seq, order.clamp(min=0)].masked_fill((order < 0)[..., None], 0.0)
    own = (bi.mark_fp32_valued(own_keys.view(b, m, -1, 128)), (order >= 0).view(b, m, -1))
    sinks = torch.randn(nh, generator=gen, dtype=torch.float64)
    return q, keys, visible, own, sinks, (entries, selected)


def _naive(q, keys, visible, own, sinks, scale):
    """FP64 softmax over the visible shared keys, the visible own keys and the sink (value 0)."""
    ok, ovis = own
    s_shared = torch.einsum("bmhd,bsd->bmhs", q, keys) * scale
    s_shared = s_shared.masked_fill(~visible[:, :, None, :], float("-inf"))
    s_own = torch.einsum("bmhd,bmkd->bmhk", q, ok) * scale
    s_own = s_own.masked_fill(~ovis[:, :, None, :], float("-inf"))
    sink = sinks[None, None, :, None].expand(*q.shape[:3], 1)
    p = torch.softmax(torch.cat((s_shared, s_own, sink), dim=-1), dim=-1)
    s = keys.shape[1]
    return torch.einsum("bmhs,bsd->bmhd", p[..., :s], keys) + torch.einsum(
        "bmhk,bmkd->bmhd", p[..., s:-1], ok
    )


def test_own_order_is_ascending_with_none_last_and_whole_columns():
    sel = torch.tensor([[7, -1, 2, 5], [-1, -1, -1, -1], [3, 1, 0, 2]])
    order = bi.own_order(sel)
    assert order.shape == (3, bi.own_layout(4)[1]) == (3, bi.OWN_COLS)
    assert (
        order[0].tolist()[:4] == [2, 5, 7, -1]
        and order[1].eq(-1).all()
        and order[2, :4].tolist() == [0, 1, 2, 3]
    )
    assert order[:, 4:].eq(-1).all()
    assert (
        bi.own_layout(8) == (8, 8) and bi.own_layout(40) == (KT, 2 * KT) and bi.own_layout(2048) == (KT, 2048)
    )


@pytest.mark.parametrize(
    ("m", "nh", "tiles", "topk"), [(1, 4, 2, 8), (1, 3, 1, 5), (5, 4, 2, 8), (70, 3, 4, 40)]
)
def test_every_path_gives_the_same_bits_and_the_softmax_attention(m, nh, tiles, topk, threads):
    gen = torch.Generator().manual_seed(11 + m + nh)
    for b in (1, 3):
        q, keys, visible, own, sinks, _ = _case(b, m, nh, tiles, topk, gen)
        assert bi.exact_scores_apply(q, keys)
        ref = bi.sink_attention(q, keys, visible, sinks, 0.088, all_tiles=True, own=own)
        exact = bi.sink_attention(q, keys, visible, sinks, 0.088, own=own)
        assert torch.equal(_bits(exact), _bits(ref))
        plan = bi.plan_attention(visible, nh)
        planned = bi.sink_attention(q, keys, None, sinks, 0.088, plan=plan, own=own)
        assert torch.equal(_bits(planned), _bits(ref))
        # the generic (not exact-score) path: q with more than FP32's bits, same for all paths
        q64 = q + 1e-9 * _fp32(*q.shape, gen=gen)
        assert not bi.exact_scores_apply(q64, keys)
        full64 = bi.sink_attention(q64, keys, visible, sinks, 0.088, all_tiles=True, own=own)
        assert torch.equal(
            _bits(bi.sink_attention(q64, keys, None, sinks, 0.088, plan=plan, own=own)), _bits(full64)
        )
        torch.testing.assert_close(ref, _naive(q, keys, visible, own, sinks, 0.088), rtol=1e-12, atol=1e-13)


def test_own_keys_change_the_result():
    """The own keys are attended (a guard against a path that drops them)."""
    gen = torch.Generator().manual_seed(3)
    q, keys, visible, own, sinks, _ = _case(2, 1, 4, 2, 8, gen)
    with_own = bi.sink_attention(q, keys, visible, sinks, 0.088, own=own)
    without = bi.sink_attention(q, keys, visible, sinks, 0.088)
    assert not torch.allclose(with_own, without)


def test_row_does_not_depend_on_the_batch_the_chunking_or_the_selection_order(threads):
    gen = torch.Generator().manual_seed(4)
    q, keys, visible, own, sinks, (entries, selected) = _case(1, 40, 4, 3, 8, gen)
    alone = bi.sink_attention(q, keys, visible, sinks, 0.088, own=own)[0]
    # among other sequences with wider shared key sets (the row gets hidden zero tiles behind)
    for b in (3, 8):
        qs, ks, vs, (ok, ov), _, _ = _case(b, 40, 4, 5, 8, gen)
        i = b // 2
        qs[i], ks[i], vs[i] = q[0], 0.0, False
        ks[i, : 3 * KT], vs[i, :, : 3 * KT] = keys[0], visible[0]
        ok[i], ov[i] = own[0][0], own[1][0]
        got = bi.sink_attention(
            qs, bi.mark_fp32_valued(ks), vs, sinks, 0.088, own=(bi.mark_fp32_valued(ok), ov)
        )
        assert torch.equal(_bits(got[i]), _bits(alone)), b
    # chunked 25 + 15, and every fourth query alone (the decode path)
    parts = [
        bi.sink_attention(
            q[:, a:z], keys, visible[:, a:z], sinks, 0.088, own=(own[0][:, a:z], own[1][:, a:z])
        )
        for a, z in ((0, 25), (25, 40))
    ]
    assert torch.equal(_bits(torch.cat(parts, dim=1)[0]), _bits(alone))
    for j in range(0, 40, 4):
        one = bi.sink_attention(
            q[:, j : j + 1],
            keys,
            visible[:, j : j + 1],
            sinks,
            0.088,
            own=(own[0][:, j : j + 1], own[1][:, j : j + 1]),
        )
        assert torch.equal(_bits(one[0, 0]), _bits(alone[j])), j
    # the same selected sets listed in another order: the same own keys, the same bits
    shuffled = selected[:, torch.randperm(selected.shape[1], generator=gen)]
    assert torch.equal(bi.own_order(shuffled), bi.own_order(selected))
