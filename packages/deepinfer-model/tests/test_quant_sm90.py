"""MXFP4 -> FP8 128x128 block conversion (quant_sm90) against the exact FP64 dequantisation."""

from __future__ import annotations

import pytest
import torch
from deepinfer_model.layers.expert_conversion import convert_moe_experts_for_sm90
from deepinfer_model.layers.experts import ExpertWeights
from deepinfer_model.layers.moe import MoEWeights
from deepinfer_model.quant import dequant_mxfp4, quant_fp8_block, quant_mxfp4
from deepinfer_model.quant_sm90 import (
    Fp8Experts,
    dequant_fp8_block_pow2,
    fp8_block_error,
    fp8_experts_from_mxfp4,
    fp8_experts_from_weights,
    mxfp4_to_fp8_block,
)

E2M1_LOWEST_BIT = {1: -1, 2: 0, 3: -1, 4: 1, 5: 0, 6: 2, 7: 1}  # log2 of each magnitude code's lowest set bit
E2M1_CEIL_LOG2_OVER_448 = {1: -9, 2: -8, 3: -8, 4: -7, 5: -7, 6: -6, 7: -6}  # ceil(log2(v / 448))


def checkpoint_like(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian weights with per-row magnitudes spread over ~3 binades and a few near-dead rows."""
    w = torch.randn(n, k, generator=gen) * k**-0.5
    w *= torch.exp2(torch.rand(n, 1, generator=gen) * 3 - 1.5)
    w[torch.randint(0, n, (max(1, n // 64),), generator=gen)] *= 2.0**-6
    return w


def test_exact_on_checkpoint_like_experts():
    gen = torch.Generator().manual_seed(0)
    for n, k in [(256, 512), (384, 256), (200, 160)]:  # the last: partial 128-blocks in both dims
        packed, scale = quant_mxfp4(checkpoint_like(n, k, gen))
        q, s = mxfp4_to_fp8_block(packed, scale)
        assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
        assert s.dtype == torch.float32 and s.shape == (-(-n // 128), -(-k // 128))
        ref = dequant_mxfp4(packed, scale).double()
        assert torch.equal(dequant_fp8_block_pow2(q, s), ref)
        assert fp8_block_error(ref, q, s).inexact_blocks == 0
        # scales are exact powers of two
        mant, _ = torch.frexp(s)
        assert bool((mant == 0.5).all())
        # the scale rule is the usual FP8 block rule: same bytes as quant_fp8_block on the FP4 values
        q2, s2 = quant_fp8_block(ref.float(), (128, 128))
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
        assert torch.equal(s, s2.view(torch.uint8).to(torch.int32).sub(127).exp2().float())


def _block_from_exponents(exps: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [128, 128] MXFP4 block: group exponents exps [128, 4], codes [128, 128] (uint8, 0..15)."""
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale


@pytest.mark.parametrize("span", [0, 7, 14])
def test_span_up_to_14_is_exact_even_in_the_worst_case(span):
    exps = torch.full((128, 4), -20, dtype=torch.int32)
    exps[0, 0] = -20 + span  # one group at e_max holding the largest code (6)
    codes = torch.full(
        (128, 128), 1, dtype=torch.uint8
    )  # 0.5 everywhere: the lowest bit of the lowest groups
    codes[0, :32] = 7
    codes[1, :] = 3 + 8  # -1.5: also needs the 2^(e-1) bit
    packed, scale = _block_from_exponents(exps, codes)
    q, s = mxfp4_to_fp8_block(packed, scale)
    assert float(s) == 2.0 ** (-20 + span - 6)
    stats = fp8_block_error(dequant_mxfp4(packed, scale), q, s)
    assert stats.inexact_blocks == 0 and stats.max_abs_err == 0.0


def test_span_15_loses_the_smallest_values_within_the_bound():
    e_max, e_min = 0, -15
    exps = torch.full((128, 4), e_min, dtype=torch.int32)
    exps[0, 0] = e_max
    codes = torch.full((128, 128), 1, dtype=torch.uint8)
    codes[0, :32] = 7  # 6 * 2^0 sets b = -6
    codes[1, :] = 3  # 1.5 * 2^-15
    packed, scale = _block_from_exponents(exps, codes)
    q, s = mxfp4_to_fp8_block(packed, scale)
    b = e_max - 6
    assert float(s) == 2.0**b
    ref = dequant_mxfp4(packed, scale).double()
    stats = fp8_block_error(ref, q, s)
    assert stats.blocks == 1 and stats.inexact_blocks == 1
    # 0.5 * 2^-15 / 2^-6 = 2^-10: a tie between 0 and 2^-9, rounds to the even 0; 1.5 * 2^-15 -> 2^-8
    got = dequant_fp8_block_pow2(q, s)
    assert float(got[2, 0]) == 0.0 and float(got[1, 0]) == 2.0 ** (b - 8)
    assert stats.max_abs_err == 2.0 ** (b - 10)  # the documented bound, reached
    assert stats.max_err_over_block_amax == 2.0 ** (b - 10) / 6.0
    assert stats.max_err_over_block_amax < 4.4e-6
    # the large groups stay exact
    assert torch.equal(got[0, :32], ref[0, :32])


def test_random_spans_follow_the_exactness_rule():
    """Many blocks with random group exponents (span 0..20) and codes: a block is exact iff every nonzero
    value's lowest bit is >= 2^(b - 9), with b = max over values of ceil(log2(v / 448)) + e; span <= 14
    always exact; every error <= 2^(b - 10)."""
    gen = torch.Generator().manual_seed(1)
    nb = 8  # 8 x 8 blocks of 128 x 128
    n = k = 128 * nb
    base = torch.randint(-40, 20, (nb, 1, nb, 1), generator=gen)
    span = torch.randint(0, 21, (nb, 1, nb, 1), generator=gen)
    u = torch.rand(nb, 128, nb, 4, generator=gen)
    exps = (base + (u * (span + 1)).floor().long().clamp(max=span)).reshape(n, k // 32)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    sparse = torch.rand(n, k, generator=gen) < 0.9  # many zeros: some blocks' extreme groups end up empty
    codes = torch.where(sparse & (torch.rand(n, 1, generator=gen) < 0.5), torch.zeros_like(codes), codes)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = (exps + 127).to(torch.uint8)
    q, s = mxfp4_to_fp8_block(packed, scale)
    ref = dequant_mxfp4(packed, scale).double()
    err = (dequant_fp8_block_pow2(q, s) - ref).abs().view(nb, 128, nb, 128)

    mag = (codes & 7).long()
    e_full = exps.repeat_interleave(32, dim=1)
    nz = mag > 0
    lut_hi = torch.tensor([-(10**6)] + [E2M1_CEIL_LOG2_OVER_448[c] for c in range(1, 8)])
    lut_lo = torch.tensor([10**6] + [E2M1_LOWEST_BIT[c] for c in range(1, 8)])
    b = (lut_hi[mag] + e_full).view(nb, 128, nb, 128).amax(dim=(1, 3))
    low = torch.where(nz, lut_lo[mag] + e_full, torch.full_like(e_full, 10**6)).view(nb, 128, nb, 128)
    predicted_exact = low.amin(dim=(1, 3)) >= b - 9
    any_nz = nz.view(nb, 128, nb, 128).any(dim=3).any(dim=1)
    b = torch.where(any_nz, b, torch.zeros_like(b))
    assert torch.equal(s, torch.exp2(b.float()))
    measured_exact = err.amax(dim=(1, 3)) == 0
    assert torch.equal(measured_exact, predicted_exact)
    e_nz = torch.where(nz, e_full, torch.full_like(e_full, -(10**6))).view(nb, 128, nb, 128)
    e_nz_min = torch.where(nz, e_full, torch.full_like(e_full, 10**6)).view(nb, 128, nb, 128)
    real_span = e_nz.amax(dim=(1, 3)) - e_nz_min.amin(dim=(1, 3))
    assert bool(measured_exact[any_nz & (real_span <= 14)].all())
    assert bool((~measured_exact).any()) and bool(measured_exact.any())  # both cases occur
    bound = torch.exp2((b - 10).double())
    assert bool((err.amax(dim=(1, 3)) <= bound).all())


def test_bad_inputs_name_the_problem():
    packed, scale = quant_mxfp4(torch.randn(128, 256))
    with pytest.raises(ValueError, match="int8/uint8"):
        mxfp4_to_fp8_block(packed.float(), scale)
    with pytest.raises(ValueError, match=r"\[..., N, K/2\]"):
        mxfp4_to_fp8_block(packed[0], scale[0])
    with pytest.raises(ValueError, match="scale must have shape"):
        mxfp4_to_fp8_block(packed, scale[:, :-1])
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_to_fp8_block(packed[:, :8], scale[:, :1])
    bad = scale.view(torch.uint8).clone()
    bad[3, 2] = 255
    with pytest.raises(ValueError, match="byte 255 out of range"):
        mxfp4_to_fp8_block(packed, bad)
    with pytest.raises(ValueError, match="float scales"):
        mxfp4_to_fp8_block(packed, torch.zeros(128, 8))
    w = (packed.unsqueeze(0), scale.unsqueeze(0))
    with pytest.raises(ValueError, match="w2 packed must be"):
        fp8_experts_from_mxfp4(w, w, w)
    with pytest.raises(ValueError, match="w1 .* and w3 .* differ"):
        fp8_experts_from_mxfp4(w, (packed[:64].unsqueeze(0), scale[:64].unsqueeze(0)), w)


def _mxfp4_experts(e: int, i: int, h: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def stack(n, k):
        parts = [quant_mxfp4(checkpoint_like(n, k, gen)) for _ in range(e)]
        return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])

    return stack(i, h), stack(i, h), stack(h, i)


def test_experts_from_mxfp4_equal_experts_from_dequantised_bf16():
    w1, w3, w2 = _mxfp4_experts(3, 256, 384, seed=2)
    fp8 = fp8_experts_from_mxfp4(w1, w3, w2)
    assert fp8.stats.inexact_blocks == 0 and fp8.stats.blocks == 3 * (4 * 3 + 3 * 2)
    assert fp8.w13.shape == (3, 512, 384) and fp8.s13.shape == (3, 4, 3)
    assert fp8.w2.shape == (3, 384, 256) and fp8.s2.shape == (3, 3, 2)
    deq = [torch.stack([dequant_mxfp4(p, s) for p, s in zip(*w, strict=True)]) for w in (w1, w3, w2)]
    got13 = dequant_fp8_block_pow2(fp8.w13, fp8.s13)
    assert torch.equal(got13[:, :256], deq[0].double()) and torch.equal(got13[:, 256:], deq[1].double())
    assert torch.equal(dequant_fp8_block_pow2(fp8.w2, fp8.s2), deq[2].double())
    # the loader dequantises first (BF16 is exact for E2M1 x 2^e): converting afterwards gives the same bytes
    again = fp8_experts_from_weights(ExpertWeights(*(d.to(torch.bfloat16) for d in deq)))
    for a, b in ((fp8.w13, again.w13), (fp8.w2, again.w2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(fp8.s13, again.s13) and torch.equal(fp8.s2, again.s2)
    # memory: 1 B/param + 4 B per 16384 params vs 0.5 B/param + 1 B per 32 params
    params = 3 * 3 * 256 * 384
    fp4_bytes = sum(t.numel() * t.element_size() for w in (w1, w3, w2) for t in w)
    assert fp4_bytes == params * 0.5 + params / 32
    assert fp8.nbytes == params + 4 * params / 16384
    assert abs(fp8.nbytes / fp4_bytes - 1.000244140625 / 0.53125) < 1e-12


def test_convert_moe_experts_in_a_weight_tree():
    w1, w3, w2 = _mxfp4_experts(2, 128, 256, seed=3)
    deq = [torch.stack([dequant_mxfp4(p, s) for p, s in zip(*w, strict=True)]) for w in (w1, w3, w2)]
    moe = MoEWeights(gate=torch.randn(2, 256), experts=ExpertWeights(*deq), shared=None)
    tree = {
        "blocks": [moe, moe],
        "other": (torch.zeros(1), [MoEWeights(torch.randn(2, 256), ExpertWeights(*deq), None)]),
    }
    odd = MoEWeights(
        torch.randn(2, 96),
        ExpertWeights(torch.randn(2, 64, 96), torch.randn(2, 64, 96), torch.randn(2, 96, 64)),
        None,
    )
    tree["odd"] = odd  # H = 96: no 1x128 activation groups, left dequantised
    stats = convert_moe_experts_for_sm90(tree)
    assert isinstance(moe.experts, Fp8Experts) and isinstance(tree["other"][1][0].experts, Fp8Experts)
    assert isinstance(odd.experts, ExpertWeights)
    assert stats.blocks == 2 * 2 * (2 * 2 + 2 * 1) and stats.inexact_blocks == 0
    assert convert_moe_experts_for_sm90(tree).blocks == 0  # already converted: nothing to do
