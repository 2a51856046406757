"""The DeepSeek-ViT encoder and the aligner against a naive FP64 re-derivation written from the description
(loops over patches, heads and channel pairs; explicit softmax and erf-GELU), at several patch grids: the
einsum reference attention and the fused one (`scaled_dot_product_attention`), in FP64, FP32 and BF16."""

import math

import pytest
import torch
from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, random_v41_tensors, tiny_v41_config_dict
from deepinfer_model.models.deepseek_v41.vision import (
    VisionTower,
    VisionWeights,
    axial_rope_angles,
    default_dtype,
    encode_image,
    pixel_unshuffle,
    resolve_attention,
)


@pytest.fixture(scope="module")
def tower():
    cfg = DeepseekV41Config.from_dict(tiny_v41_config_dict(vision_tower=True))
    values = random_v41_tensors(cfg, seed=5)
    # the checkpoint stores BF16: use BF16-valued weights as the loader would give them
    values = {k: v.to(torch.bfloat16).float() for k, v in values.items()}
    return VisionTower(cfg.vision, VisionWeights.from_tensors(cfg.vision, values.__getitem__))


def _naive_rms(x, w, eps):
    out = torch.empty_like(x)
    for n in range(x.shape[0]):
        ms = sum(float(v) ** 2 for v in x[n]) / x.shape[1]
        out[n] = x[n] / math.sqrt(ms + eps) * w
    return out


def _naive_rope(x, row, col, theta):
    """x [heads, dh] of one patch: channel pair j of the first half turns by row * f_j, of the second by col * f_j."""
    dh = x.shape[-1]
    half = dh // 2
    y = x.clone()
    for h in range(x.shape[0]):
        for base, pos in ((0, row), (half, col)):
            for j in range(half // 2):
                ang = pos * theta ** (-(2 * j) / half)
                a, b = float(x[h, base + 2 * j]), float(x[h, base + 2 * j + 1])
                y[h, base + 2 * j] = a * math.cos(ang) - b * math.sin(ang)
                y[h, base + 2 * j + 1] = a * math.sin(ang) + b * math.cos(ang)
    return y


def _naive_tower(patches, rows, cols, tw: VisionTower):
    c, w = tw.config, tw.weights
    W, nh, dh, eps = c.hidden_size, c.num_attention_heads, c.head_dim, c.rms_norm_eps
    d = lambda t: t.double()  # noqa: E731
    x = patches.double() @ d(w.patch_embed).T + d(w.patch_bias)
    N = rows * cols
    for blk in w.blocks:
        h = _naive_rms(x, d(blk.norm1), eps)
        qkv = h @ d(blk.qkv).T + d(blk.qkv_bias)
        q = qkv[:, :W].reshape(N, nh, dh)
        k = qkv[:, W : 2 * W].reshape(N, nh, dh)
        v = qkv[:, 2 * W :].reshape(N, nh, dh)
        for n in range(N):
            q[n] = _naive_rope(q[n], n // cols, n % cols, c.rope_theta)
            k[n] = _naive_rope(k[n], n // cols, n % cols, c.rope_theta)
        att = torch.zeros(N, nh, dh, dtype=torch.float64)
        for hd in range(nh):
            for i in range(N):
                s = [float(q[i, hd] @ k[j, hd]) / math.sqrt(dh) for j in range(N)]
                mx = max(s)
                e = [math.exp(v_ - mx) for v_ in s]
                z = sum(e)
                for j in range(N):
                    att[i, hd] += e[j] / z * v[j, hd]
        x = x + att.reshape(N, W) @ d(blk.proj).T
        h = _naive_rms(x, d(blk.norm2), eps)
        gu = h @ d(blk.w13).T
        I = c.intermediate_size  # noqa: E741
        g, u = gu[:, :I], gu[:, I:]
        x = x + (g / (1 + torch.exp(-g)) * u) @ d(blk.w2).T
    x = _naive_rms(x, d(w.norm), eps)
    r = c.downsample_ratio
    cells = []
    for i in range(rows // r):
        for j in range(cols // r):
            cells.append(torch.cat([x[(r * i + a) * cols + r * j + b] for a in range(r) for b in range(r)]))
    m = torch.stack(cells)
    h = m @ d(w.fc1).T + d(w.fc1_bias)
    h = h.apply_(lambda t: 0.5 * t * (1 + math.erf(t / math.sqrt(2))))
    return h @ d(w.fc2).T + d(w.fc2_bias)


@pytest.mark.parametrize("rows,cols", [(2, 2), (2, 6), (6, 4), (4, 4), (8, 2)])
def test_tower_matches_naive_fp64(tower, rows, cols):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    patches = torch.rand(rows * cols, tower.config.patch_dim, generator=g) * 2 - 1
    want = _naive_tower(patches, rows, cols, tower)
    got64 = tower.embed_image(patches, rows, cols, dtype=torch.float64)
    got32 = tower.embed_image(patches, rows, cols)
    assert got64.shape == (rows // 2 * cols // 2, 128)
    torch.testing.assert_close(got64, want, rtol=1e-10, atol=1e-10)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=2e-4, atol=2e-4)


def test_rope_scores_depend_only_on_the_offset():
    """After the axial rotation q.k depends on (row offset, column offset) only, not on where the pair sits."""
    dh, theta = 16, 10000.0
    ang = axial_rope_angles(5, 7, dh, theta, torch.float64)
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(dh, generator=g, dtype=torch.float64),
        torch.randn(dh, generator=g, dtype=torch.float64),
    )

    def rot(x, a):
        e, o = x[0::2], x[1::2]
        return torch.stack([e * a.cos() - o * a.sin(), e * a.sin() + o * a.cos()], -1).flatten()

    def score(p1, p2):
        return float(rot(q, ang[p1[0] * 7 + p1[1]]) @ rot(k, ang[p2[0] * 7 + p2[1]]))

    assert score((0, 0), (1, 2)) == pytest.approx(score((3, 4), (4, 6)), abs=1e-12)
    assert score((2, 5), (0, 1)) == pytest.approx(score((4, 6), (2, 2)), abs=1e-12)
    assert score((0, 0), (1, 0)) != pytest.approx(score((0, 0), (0, 1)), abs=1e-6)  # axes differ


def test_attention_spans_the_whole_image(tower):
    """Bidirectional: changing the last patch changes the first patch's feature (no causal mask)."""
    rows, cols = 4, 4
    p = torch.rand(rows * cols, tower.config.patch_dim, generator=torch.Generator().manual_seed(1))
    a = encode_image(p, rows, cols, tower.weights, tower.config, torch.float64)
    p2 = p.clone()
    p2[-1] += 1.0
    b = encode_image(p2, rows, cols, tower.weights, tower.config, torch.float64)
    assert not torch.allclose(a[0], b[0])


def test_pixel_unshuffle_order():
    feats = torch.arange(4 * 6).float()[:, None]  # patch id as its feature, grid 4 x 6
    m = pixel_unshuffle(feats, 4, 6, 2)
    assert (
        m.tolist()[0] == [0, 1, 6, 7] and m.tolist()[1] == [2, 3, 8, 9] and m.tolist()[3] == [12, 13, 18, 19]
    )
    with pytest.raises(ValueError, match="multiple of the merge size 2"):
        pixel_unshuffle(torch.zeros(15, 1), 3, 5, 2)


def test_patch_shape_is_checked(tower):
    with pytest.raises(ValueError, match=r"patches must have shape \[rows\*cols, C\*p\*p\] = \[4, 588\]"):
        tower.embed_image(torch.zeros(4, 10), 2, 2)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("rows,cols", [(2, 2), (2, 6), (6, 4), (8, 2)])
def test_fused_attention_matches_naive_fp64(tower, rows, cols):
    """The fused path in FP64 agrees with the re-derivation to rounding (the layout, scale and lack of a
    mask are right), in FP32 as tightly as the reference path does."""
    g = torch.Generator().manual_seed(rows * 100 + cols)
    patches = torch.rand(rows * cols, tower.config.patch_dim, generator=g) * 2 - 1
    want = _naive_tower(patches, rows, cols, tower)
    got64 = tower.embed_image(patches, rows, cols, dtype=torch.float64, attention="fused")
    got32 = tower.embed_image(patches, rows, cols, dtype=torch.float32, attention="fused")
    torch.testing.assert_close(got64, want, rtol=1e-10, atol=1e-10)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("attention", ["fused", "reference"])
@pytest.mark.parametrize("rows,cols", [(2, 2), (6, 4), (8, 8)])
def test_bf16_matches_naive_fp64(tower, rows, cols, attention):
    """BF16 math: weights, patches and every GEMM / attention input carry 8 significant bits (unit roundoff
    u = 2**-8); the path has about 15 rounding points (patch embedding, 6 per block, the aligner's 2, the
    output), each within u/2 of the exact value, so the output's relative error is a few u: it must stay
    below 8u = 3.1e-2 (measured 0.7-1.3e-2) and above 1e-3, far above FP32's 1e-6 (the math did run in BF16).
    The residual stream stays FP32 (`residual_dtype`)."""
    g = torch.Generator().manual_seed(rows * 100 + cols)
    patches = torch.rand(rows * cols, tower.config.patch_dim, generator=g) * 2 - 1
    want = _naive_tower(patches, rows, cols, tower)
    got = tower.embed_image(patches, rows, cols, dtype=torch.bfloat16, attention=attention)
    assert got.dtype == torch.bfloat16
    assert 1e-3 < _rel_err(got, want) < 8 * 2**-8
    feats = encode_image(patches, rows, cols, tower.weights, tower.config, torch.bfloat16, attention)
    assert feats.dtype == torch.float32


def test_device_defaults_and_bad_settings(tower):
    assert tower.default_dtype == torch.float32 and default_dtype("cuda") == torch.bfloat16
    assert resolve_attention("auto", "cpu") == "reference" and resolve_attention("auto", "cuda:0") == "fused"
    assert resolve_attention("fused", "cpu") == "fused"
    p = torch.zeros(4, tower.config.patch_dim)
    with pytest.raises(ValueError, match=r"attention must be one of auto, fused, reference, got 'flash'"):
        tower.embed_image(p, 2, 2, attention="flash")
    with pytest.raises(
        ValueError, match=r"dtype must be one of float64, float32, bfloat16, float16, got torch.int32"
    ):
        tower.embed_image(p, 2, 2, dtype=torch.int32)


def test_weights_are_cast_once_per_dtype(tower):
    """The tower keeps one cast per math dtype (matrices in it, RMSNorm weights in the residual dtype) and
    reuses it; weights already in a dtype are not copied."""
    p = torch.rand(4, tower.config.patch_dim, generator=torch.Generator().manual_seed(3))
    tower.embed_image(p, 2, 2, dtype=torch.bfloat16)
    w16 = tower.weights_for(torch.bfloat16)
    tower.embed_image(p, 2, 2, dtype=torch.bfloat16)
    assert tower.weights_for(torch.bfloat16) is w16
    assert w16.blocks[0].qkv.dtype == torch.bfloat16 and w16.fc2.dtype == torch.bfloat16
    assert w16.blocks[0].norm1.dtype == torch.float32 and w16.norm.dtype == torch.float32
    assert tower.weights_for(torch.float32) is tower.weights  # (the loader's FP32 weights as they are)
    assert w16.cast(torch.bfloat16, torch.float32) is w16
