"""Each shared block against a naive float64 loop written straight from the spec's formulas."""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_model.config import RopeSpec, YarnScaling
from deepinfer_model.layers import (
    CompressorWeights,
    ExpertWeights,
    HCParams,
    MLPWeights,
    apply_rope,
    compress,
    cos_sin,
    experts_forward,
    index_scores,
    inv_freq,
    mixes,
    read,
    sink_attention,
    sinkhorn,
    write,
)
from deepinfer_model.numerics import linear

GEN = torch.Generator().manual_seed(0)


def rnd(*shape, std=1.0):
    return torch.randn(*shape, generator=GEN, dtype=torch.float64) * std


def test_sink_attention_matches_naive_loop():
    t, nh, d, s = 5, 3, 8, 7
    q, keys, sinks = rnd(t, nh, d), rnd(s, d), rnd(nh)
    visible = torch.rand(t, s, generator=GEN) > 0.4
    visible[0] = False  # a query with no key returns zeros
    out = sink_attention(q, keys, visible, sinks, d**-0.5)
    for i in range(t):
        for h in range(nh):
            idx = visible[i].nonzero().flatten().tolist()
            logits = [float(q[i, h] @ keys[j]) * d**-0.5 for j in idx]
            denom = sum(math.exp(x) for x in logits) + math.exp(float(sinks[h]))
            want = (
                sum((math.exp(x) / denom) * keys[j] for x, j in zip(logits, idx)) if idx else torch.zeros(d)
            )
            assert torch.allclose(out[i, h], torch.as_tensor(want, dtype=torch.float64), atol=1e-12)
    # per-query key sets [T, S, D] give the same result as a shared key list
    assert torch.allclose(sink_attention(q, keys.expand(t, s, d), visible, sinks, d**-0.5), out, atol=1e-12)


def _naive_compress(x, w, ratio, overlap, rope, eps):
    d = w.norm.shape[0]
    kv, gate = x @ w.wkv.T, x @ w.wgate.T
    n = x.shape[0] // ratio
    rows = []
    for j in range(n):
        slots = []  # (value, gate logit) per channel, over the window's slots
        for r in range(ratio):
            tok = j * ratio + r
            b = w.ape[r] if w.ape is not None else torch.zeros(kv.shape[1], dtype=torch.float64)
            if overlap:
                slots.append((kv[tok, d:], gate[tok, d:] + b[d:]))
                if j > 0:
                    prev = (j - 1) * ratio + r
                    slots.append((kv[prev, :d], gate[prev, :d] + b[:d]))
            else:
                slots.append((kv[tok], gate[tok] + b))
        vals = torch.stack([v for v, _ in slots])
        weights = torch.softmax(torch.stack([g for _, g in slots]), dim=0)
        pooled = (vals * weights).sum(0)
        normed = pooled / torch.sqrt((pooled**2).mean() + eps) * w.norm
        rows.append(normed)
    pre = torch.stack(rows) if rows else torch.zeros(0, d, dtype=torch.float64)
    pos = torch.arange(n) * ratio
    c, s = cos_sin(rope, pos)
    return pre, apply_rope(pre, c, s), pos


def test_compressor_matches_naive_pooling():
    h, d, rope = 16, 8, RopeSpec(10000.0, 4)
    x = rnd(19, h)
    for ratio, overlap in ((4, True), (3, False), (2, False)):
        width = 2 * d if overlap else d
        w = CompressorWeights(
            rnd(width, h, std=0.3), rnd(width, h, std=0.3), 1 + rnd(d, std=0.1), rnd(ratio, width)
        )
        got = compress(x, w, ratio, overlap, rope, 1e-6)
        pre, keys, pos = _naive_compress(x, w, ratio, overlap, rope, 1e-6)
        assert got.keys.shape == (19 // ratio, d)
        assert torch.equal(got.positions, pos)
        assert torch.allclose(got.pre_rope, pre, atol=1e-6) and torch.allclose(got.keys, keys, atol=1e-6)
    # ratio 1 without a gate: every token is its own entry
    w1 = CompressorWeights(rnd(d, h), None, torch.ones(d, dtype=torch.float64))
    got = compress(x, w1, 1, False, rope, 1e-6)
    kv = x @ w1.wkv.T
    assert torch.allclose(got.pre_rope, kv / torch.sqrt((kv**2).mean(-1, keepdim=True) + 1e-6), atol=1e-6)


def test_rope_relative_and_inverse():
    spec = RopeSpec(500.0, 8, YarnScaling(4.0, 16, 32.0, 1.0))
    q, k = rnd(1, 12), rnd(1, 12)
    dots = []
    for p in (0, 5, 17):
        cq, sq = cos_sin(spec, torch.tensor([p + 3]))
        ck, sk = cos_sin(spec, torch.tensor([p]))
        dots.append(float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()))
    assert max(dots) - min(dots) < 1e-5  # depends only on the distance
    c, s = cos_sin(spec, torch.tensor([9]))
    rotated = apply_rope(q, c, s)
    assert torch.equal(rotated[:, :4], q[:, :4])  # leading channels untouched
    assert torch.allclose(apply_rope(rotated, c, s, inverse=True), q, atol=1e-6)


def test_yarn_frequencies_by_hand():
    base, dim, factor, orig = 10000.0, 16, 8.0, 256
    plain = inv_freq(RopeSpec(base, dim))
    yarn = inv_freq(RopeSpec(base, dim, YarnScaling(factor, orig, 32.0, 1.0)))

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(32.0)), 0), min(math.ceil(corr(1.0)), dim - 1)
    for i in range(dim // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want = plain[i].item() / factor * ramp + plain[i].item() * (1 - ramp)
        assert math.isclose(yarn[i].item(), want, rel_tol=1e-6)
    assert yarn[0] == plain[0] and math.isclose(yarn[-1].item(), plain[-1].item() / factor, rel_tol=1e-6)


def _naive_sinkhorn(c0, eps, iters):
    m = c0.shape[0]
    c = [[0.0] * m for _ in range(m)]
    for i in range(m):
        row = [math.exp(float(c0[i, j])) for j in range(m)]
        for j in range(m):
            c[i][j] = row[j] / sum(row) + eps
    for it in range(iters):
        if it:  # rows (all rounds but the first)
            for i in range(m):
                s = sum(c[i]) + eps
                c[i] = [v / s for v in c[i]]
        for j in range(m):  # columns
            s = sum(c[i][j] for i in range(m)) + eps
            for i in range(m):
                c[i][j] /= s
    return torch.tensor(c, dtype=torch.float64)


def test_mhc_mixes_read_write_match_naive():
    t, m, h = 3, 4, 8
    trunk = rnd(t, m, h)
    p = HCParams(rnd((2 + m) * m, m * h, std=0.2), rnd((2 + m) * m), rnd(3).abs() + 0.5)
    pre, post, comb = mixes(trunk, p, 1e-6, 1e-6, 20)
    for i in range(t):
        flat = trunk[i].flatten()
        z = (p.fn @ flat) / torch.sqrt((flat**2).mean() + 1e-6)
        u = z * torch.cat([p.scale[0].repeat(m), p.scale[1].repeat(m), p.scale[2].repeat(m * m)]) + p.base
        assert torch.allclose(pre[i], torch.sigmoid(u[:m]) + 1e-6, atol=1e-6)
        assert torch.allclose(post[i], 2 * torch.sigmoid(u[m : 2 * m]), atol=1e-6)
        assert torch.allclose(comb[i], _naive_sinkhorn(u[2 * m :].view(m, m), 1e-6, 20), atol=1e-6)
    # Sinkhorn output is (nearly) doubly stochastic
    ones = torch.ones(t, m, dtype=torch.float64)
    # columns are normalised last (exact up to eps); rows converge
    assert torch.allclose(comb.sum(-2), ones, atol=1e-5) and torch.allclose(comb.sum(-1), ones, atol=0.05)
    assert torch.equal(
        sinkhorn(u[2 * m :].view(1, m, m), 1e-6, 20)[0], sinkhorn(u[2 * m :].view(m, m), 1e-6, 20)
    )
    y = rnd(t, h)
    new = write(y, trunk, post, comb)
    for j in range(m):
        want = post[:, j, None] * y + sum(comb[:, i, j, None] * trunk[:, i] for i in range(m))
        assert torch.allclose(new[:, j], want, atol=1e-6)
    assert torch.allclose(read(trunk, pre), sum(pre[:, i, None] * trunk[:, i] for i in range(m)), atol=1e-6)


def test_moe_matches_per_token_loop():
    t, h, i, e, k = 6, 8, 4, 5, 2
    x = rnd(t, h)
    experts = ExpertWeights(rnd(e, i, h), rnd(e, i, h), rnd(e, h, i))
    shared = MLPWeights(rnd(i, h), rnd(i, h), rnd(h, i))
    ids = torch.stack([torch.randperm(e, generator=GEN)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=GEN)
    limit = 1.5

    def swiglu(w1, w3, w2, v):
        g, u = (w1 @ v).clamp(max=limit), (w3 @ v).clamp(-limit, limit)
        return w2 @ (g * torch.sigmoid(g) * u)

    for before in (False, True):
        out = experts_forward(
            x, weights, ids, experts, shared, limit, torch.float32, weight_before_down=before
        )
        for r in range(t):
            want = swiglu(shared.w1, shared.w3, shared.w2, x[r])
            for s in range(k):
                ex = ids[r, s]
                want = want + weights[r, s] * swiglu(experts.w1[ex], experts.w3[ex], experts.w2[ex], x[r])
            assert torch.allclose(out[r], want, rtol=1e-5, atol=1e-5)


def test_index_scores_match_naive():
    q, keys, w = rnd(4, 3, 8), rnd(5, 8), rnd(4, 3)
    got = index_scores(q, keys, w, scaled=True)
    for t in range(4):
        for j in range(5):
            want = sum(w[t, h] * max(float(q[t, h] @ keys[j]), 0.0) for h in range(3)) / math.sqrt(8 * 3)
            assert math.isclose(got[t, j].item(), float(want), rel_tol=1e-9, abs_tol=1e-12)


def test_linear_rows_do_not_depend_on_batch_shape():
    x, w = torch.randn(40, 96, generator=GEN), torch.randn(80, 96, generator=GEN)
    full = linear(x, w)
    for m in (1, 2, 3, 7, 13, 39):
        assert torch.equal(linear(x[:m], w), full[:m])


def test_compressor_continues_a_sequence_in_chunks():
    """What a cache relies on: compressing blocks 0..k-1 and then k.. gives the whole-sequence entries."""
    h, d, rope = 16, 8, RopeSpec(10000.0, 4)
    x = rnd(24, h)
    for ratio, overlap in ((4, True), (2, False)):
        width = 2 * d if overlap else d
        w = CompressorWeights(
            rnd(width, h, std=0.3), rnd(width, h, std=0.3), 1 + rnd(d, std=0.1), rnd(ratio, width)
        )
        whole = compress(x, w, ratio, overlap, rope, 1e-6)
        cut = 3 * ratio
        head = compress(x[:cut], w, ratio, overlap, rope, 1e-6)
        prev = x[cut - ratio : cut] if overlap else None
        tail = compress(x[cut:], w, ratio, overlap, rope, 1e-6, start_position=cut, prev_block=prev)
        assert torch.equal(torch.cat((head.keys, tail.keys)), whole.keys)
        assert torch.equal(torch.cat((head.positions, tail.positions)), whole.positions)
    with pytest.raises(ValueError, match="prev_block"):
        compress(x[8:], w, 4, True, rope, 1e-6, start_position=8)
    with pytest.raises(ValueError, match="multiple of the ratio"):
        compress(x, w, 2, False, rope, 1e-6, start_position=3)
