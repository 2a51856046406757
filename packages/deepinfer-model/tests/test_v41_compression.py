"""C1 / C2 compression, V4.1 index keys and candidate blocks against short float64 re-derivations."""

import math

import torch
from deepinfer_model.config import RopeSpec, YarnScaling
from deepinfer_model.layers.compressor import CompressorWeights, compress
from deepinfer_model.layers.rope import inv_freq
from deepinfer_model.models.deepseek_v41.sparse import candidate_blocks, candidate_mask, index_keys

ROPE = RopeSpec(160000.0, 8, YarnScaling(4.0, 64, 32, 1))
EPS = 1e-6


def _rms(x, w):
    return x / torch.sqrt((x * x).mean() + EPS) * w


def _rope_tail(x, pos):
    """Interleaved rotation of the last 8 channels by pos * inv_freq, float64."""
    x = x.clone()
    f = inv_freq(ROPE).double()
    for i in range(4):
        a, b = x[-8 + 2 * i].item(), x[-8 + 2 * i + 1].item()
        c, s = math.cos(pos * f[i].item()), math.sin(pos * f[i].item())
        x[-8 + 2 * i], x[-8 + 2 * i + 1] = a * c - b * s, a * s + b * c
    return x


def _weights(ratio, d=16, h=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    wgate = torch.randn(d, h, generator=g) if ratio == 2 else None
    return CompressorWeights(torch.randn(d, h, generator=g) / 3, wgate, 1 + 0.1 * torch.randn(d, generator=g))


def test_c2_gated_two_token_pooling():
    w = _weights(2)
    x = torch.randn(9, 12, generator=torch.Generator().manual_seed(1))  # 9 tokens -> 4 complete blocks
    got = compress(x, w, 2, False, ROPE, EPS)
    assert got.keys.shape == (4, 16) and got.positions.tolist() == [0, 2, 4, 6]
    X, A, Gt = x.double(), w.wkv.double(), w.wgate.double()
    for j in range(4):
        s0, s1 = Gt @ X[2 * j], Gt @ X[2 * j + 1]  # per-channel gate logits of the block's two tokens
        v0, v1 = A @ X[2 * j], A @ X[2 * j + 1]
        pooled = (s0.exp() * v0 + s1.exp() * v1) / (s0.exp() + s1.exp())
        pre = _rms(pooled, w.norm.double())
        torch.testing.assert_close(got.pre_rope.double()[j], pre, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.keys.double()[j], _rope_tail(pre, 2 * j), rtol=1e-5, atol=1e-5)


def test_c1_one_entry_per_token_without_gate():
    w = _weights(1)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(2))
    got = compress(x, w, 1, False, ROPE, EPS)
    assert got.positions.tolist() == [0, 1, 2, 3, 4]
    for j in range(5):
        pre = _rms(w.wkv.double() @ x[j].double(), w.norm.double())
        torch.testing.assert_close(got.keys.double()[j], _rope_tail(pre, j), rtol=1e-5, atol=1e-5)


def test_index_keys_from_compressed_latent():
    g = torch.Generator().manual_seed(3)
    pre = torch.randn(6, 16, generator=g)
    wk, kn = torch.randn(12, 16, generator=g) / 4, 1 + 0.1 * torch.randn(12, generator=g)
    pos = torch.arange(6) * 2
    got = index_keys(pre, pos, wk, kn, ROPE, EPS)
    for j in range(6):
        k = _rms(wk.double() @ pre[j].double(), kn.double())
        torch.testing.assert_close(got.double()[j], _rope_tail(k, 2 * j), rtol=1e-5, atol=1e-5)


def _ref_candidates(scores, klen, bsize, nblocks):
    """Per query: block score = max over its valid entries (newest block +inf), best nblocks, ascending."""
    out = []
    for t in range(scores.shape[0]):
        nb = -(-klen[t] // bsize)
        blk = []
        for b in range(nb):
            best = max(float(scores[t, j]) for j in range(b * bsize, min((b + 1) * bsize, klen[t])))
            blk.append(math.inf if b == nb - 1 else min(best, torch.finfo(torch.bfloat16).max))
        order = sorted(range(nb), key=lambda b: (-blk[b], b))[:nblocks]
        out.append(sorted(order) + [-1] * (nblocks - len(order)))
    return out


def test_candidate_blocks_match_reference():
    g = torch.Generator().manual_seed(4)
    t, n, bsize, nblocks = 40, 40, 4, 3
    scores = torch.randn(t, n, generator=g).to(torch.bfloat16).double()
    scores[5, :] = 0.0  # ties -> lower block id first
    klen = [(p + 1) // 1 for p in range(t)]
    valid = torch.arange(n)[None, :] < torch.tensor(klen)[:, None]
    got = candidate_blocks(scores, valid, bsize, nblocks)
    assert got.tolist() == _ref_candidates(scores, klen, bsize, nblocks)
    mask = candidate_mask(got, n, bsize)
    for q in range(t):
        want = [j for j in range(n) if j // bsize in got[q].tolist()]
        assert mask[q].nonzero().flatten().tolist() == want


def test_fp4_main_kv_format_matches_scalar_reference():
    from deepinfer_model.models.deepseek_v41.kv_quant import fake_quant_fp4_e4m3

    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(7)) * 3
    x[2, 16:] = 1e-5  # tiny group: amax floor 6 * 2^-9
    got = fake_quant_fp4_e4m3(x)
    for r in range(3):
        for g0 in (0, 16):
            grp = x[r, g0 : g0 + 16].double()
            amax = max(float(grp.abs().max()), 6 * 2.0**-9)
            scale = float(torch.tensor(amax / 6).to(torch.float8_e4m3fn).double())  # E4M3, not a power of two
            for c in range(16):
                a = min(abs(float(grp[c])) / scale, 6.0)
                best = min(range(8), key=lambda i: (abs(grid[i] - a), i % 2))  # nearest, ties to even code
                want = math.copysign(grid[best], float(grp[c])) * scale
                assert abs(float(got[r, g0 + c]) - want) < 1e-12 * max(1.0, abs(want))
