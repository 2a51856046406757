"""FP8-E4M3 / UE8M0 / MXFP4 formats against hand-decoded references and torch.float8_e4m3fn."""

from __future__ import annotations

import pytest
import torch
from deepinfer_model.quant import (
    dequant_fp8_block,
    dequant_mxfp4,
    e2m1_decode,
    e2m1_encode,
    fake_quant_fp4,
    fake_quant_fp8,
    float_to_ue8m0,
    pow2_ceil,
    quant_fp8_block,
    quant_mxfp4,
    ue8m0_to_float,
)

# E2M1 decoded by hand from the OCP MX spec: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0
MXFP4_TABLE = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5, 0b1100: -2.0, 0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0,
}  # fmt: skip


def _e4m3_by_hand(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def test_e4m3_bytes_decode_like_torch():
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    for byte in range(256):
        want = _e4m3_by_hand(byte)
        got = torch_values[byte].item()
        assert (want != want and got != got) or want == got, (byte, want, got)


def test_ue8m0_round_trip_and_nan():
    raw = torch.arange(256, dtype=torch.uint8)
    values = ue8m0_to_float(raw.view(torch.float8_e8m0fnu))
    assert values[127] == 1.0 and values[130] == 8.0 and values[0] == 2.0**-127 and values[255].isnan()
    assert torch.equal(float_to_ue8m0(values[:255]).view(torch.uint8), raw[:255])
    with pytest.raises(ValueError, match="powers of two"):
        float_to_ue8m0(torch.tensor([3.0]))


def test_pow2_ceil_keeps_exact_powers():
    x = torch.tensor([1.0, 1.5, 0.25, 0.3, 448.0, 2.0**-20 * 1.01])
    assert pow2_ceil(x).tolist() == [1.0, 2.0, 0.25, 0.5, 512.0, 2.0**-19]


def test_fp8_block_quant_matches_torch_cast():
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0)) * 3
    block = (16, 32)
    q, scale = quant_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (3, 3)
    s = ue8m0_to_float(scale)
    for bi in range(3):
        for bj in range(3):
            blk = w[bi * 16 : (bi + 1) * 16, bj * 32 : (bj + 1) * 32]
            want_scale = 2.0 ** torch.ceil(torch.log2(blk.abs().max() / 448)).item()
            assert s[bi, bj].item() == want_scale
            want = (blk / want_scale).to(torch.float8_e4m3fn).float() * want_scale
            got = dequant_fp8_block(q, scale, block)[bi * 16 : (bi + 1) * 16, bj * 32 : (bj + 1) * 32]
            assert torch.equal(got, want)
    # float (non-UE8M0) scales are accepted as well
    assert torch.equal(dequant_fp8_block(q, s, block), dequant_fp8_block(q, scale, block))


def test_mxfp4_hand_table():
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_decode(codes).tolist() == [MXFP4_TABLE[c] for c in range(16)]


def test_mxfp4_packing_low_nibble_is_even_column():
    # one row of 32 values: bytes 0x21 -> columns (0, 1) = codes (1, 2) = (0.5, 1.0); scale byte 128 = x2
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21
    packed[0, 15] = 0xF9  # columns 30, 31 = codes 9, 15 = -0.5, -6
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = dequant_mxfp4(packed.view(torch.int8), scale)
    assert out.shape == (1, 32)
    assert out[0, :2].tolist() == [1.0, 2.0] and out[0, 30:].tolist() == [-1.0, -12.0]
    assert out[0, 2:30].abs().sum() == 0


def test_e2m1_rounding_is_nearest_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 7.0, -2.4, -0.1])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, -2.0, -0.0]


def test_mxfp4_round_trip_on_representable_values():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    exps = torch.randint(-4, 5, (8, 2), generator=gen)
    values = e2m1_decode(codes) * (2.0**exps).repeat_interleave(32, dim=1)
    packed, scale = quant_mxfp4(values)
    assert packed.shape == (8, 32) and scale.shape == (8, 2)
    assert torch.equal(dequant_mxfp4(packed, scale), values)


def test_activation_fake_quant():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=gen) * 10
    q8 = fake_quant_fp8(x)
    scale = pow2_ceil(x.view(4, 2, 32).abs().amax(-1, keepdim=True) / 448)
    assert torch.equal(q8, ((x.view(4, 2, 32) / scale).to(torch.float8_e4m3fn).float() * scale).view(4, 64))
    q4 = fake_quant_fp4(x)
    s4 = pow2_ceil(x.view(4, 2, 32).abs().amax(-1, keepdim=True) / 6)
    grid = (q4.view(4, 2, 32) / s4).abs()
    assert set(grid.unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert torch.equal(fake_quant_fp4(q4), q4)  # already representable -> unchanged
