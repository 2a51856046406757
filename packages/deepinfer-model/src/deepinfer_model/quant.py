"""Block-scaled weight formats of DeepSeek checkpoints (spec §9) and activation fake-quantisation (§10.3).

* FP8: `float8_e4m3fn` weights with one scale per `[b0, b1]` block (UE8M0 power of two, or FP32).
* MXFP4: two E2M1 codes per byte (low nibble = even column), one UE8M0 scale per 1x32 block along the
  input dimension. E2M1: bit 3 = sign, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
* UE8M0: one byte `e`, value `2^(e - 127)`.
"""

from __future__ import annotations

import functools

import torch

from .compile_boundary import as_custom_op, custom_ops_enabled, outside_compiled_graph

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device="cpu")
MXFP4_BLOCK = 32
# round-to-nearest boundaries between consecutive E2M1 magnitudes
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device="cpu")


@outside_compiled_graph  # traced, the cache is skipped: a host-to-device copy in the graph
@functools.lru_cache(maxsize=16)
def _on(table: str, device: torch.device) -> torch.Tensor:
    """A constant table on `device`, copied there once (quantisation runs where its input lives)."""
    return {"values": E2M1_VALUES, "midpoints": _E2M1_MIDPOINTS}[table].to(device)


def _table_copy(like: torch.Tensor, table: str) -> torch.Tensor:
    return _on(table, like.device).clone()


def _table_fake(like: torch.Tensor, table: str) -> torch.Tensor:
    return like.new_empty(
        {"values": E2M1_VALUES, "midpoints": _E2M1_MIDPOINTS}[table].shape, dtype=torch.float32
    )


# Inside a compiled region a table comes from a custom op (a copy of the cached one: one small kernel) instead
# of a graph break at every use
_TABLE_OP = (
    as_custom_op("deepinfer::quant_table", _table_copy, "(Tensor like, str table) -> Tensor", _table_fake)
    if custom_ops_enabled()
    else None
)


def _table(table: str, like: torch.Tensor) -> torch.Tensor:
    """The constant E2M1 table `table` on `like`'s device."""
    if _TABLE_OP is not None and torch.compiler.is_compiling():
        return _TABLE_OP(like, table)
    return _on(table, like.device)


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (`float8_e8m0fnu` or uint8) -> FP32 powers of two (byte 255 -> NaN)."""
    e = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    out = torch.ldexp(torch.ones(e.shape, device=e.device), e.to(torch.int32) - 127)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (FP32) -> `float8_e8m0fnu` bytes."""
    mant, exp = torch.frexp(scale.float())
    if not bool((mant == 0.5).all()):
        raise ValueError("UE8M0 scales must be exact powers of two")
    return (exp - 1 + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint scale tensor (UE8M0 bytes or float) -> FP32."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return ue8m0_to_float(scale)
    return scale.float()


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), from the FP32 bit pattern: exact powers stay unchanged."""
    mant, exp = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), torch.where(mant == 0.5, exp - 1, exp))


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    s = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return s[: shape[0], : shape[1]]


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8-E4M3 weight [R, C] with scales [ceil(R/b0), ceil(C/b1)] -> FP32 [R, C]."""
    return weight.float() * _expand_blocks(scale_to_float(scale), weight.shape, block)


def quant_fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 [R, C] -> (float8_e4m3fn [R, C], UE8M0 scales): per block `scale = 2^ceil(log2(amax/448))`."""
    r, c = weight.shape
    b0, b1 = block
    nr, nc = -(-r // b0), -(-c // b1)
    padded = torch.zeros(nr * b0, nc * b1, device=weight.device)
    padded[:r, :c] = weight.float()
    amax = padded.abs().view(nr, b0, nc, b1).amax(dim=(1, 3)).clamp(min=1e-4)
    scale = pow2_ceil(amax / E4M3_MAX)
    q = (weight.float() / _expand_blocks(scale, weight.shape, block)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), float_to_ue8m0(scale)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32 values (already scaled into [-6, 6]) -> 4-bit E2M1 codes (uint8), round-to-nearest-even."""
    a = x.float().abs().clamp(max=E2M1_MAX)
    midpoints = _table("midpoints", a)
    code = torch.searchsorted(midpoints, a, right=True)
    tie = (a.unsqueeze(-1) == midpoints).any(-1)
    code = torch.where(tie & (code % 2 == 1), code - 1, code)  # ties go to the even code
    sign = (x < 0) & (code > 0)
    return (code + 8 * sign.long()).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes -> FP32 values."""
    codes = codes.long()
    mag = _table("values", codes)[codes & 7]
    return torch.where(codes & 8 != 0, -mag, mag)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 [R, C/2] (int8/uint8, low nibble = even column) + scales [R, C/32] -> FP32 [R, C]."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    values = e2m1_decode(codes)
    return values * scale_to_float(scale).repeat_interleave(MXFP4_BLOCK, dim=-1)[..., : values.shape[-1]]


def quant_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 [R, C] (C % 32 == 0) -> (packed int8 [R, C/2], UE8M0 scales [R, C/32])."""
    r, c = weight.shape
    if c % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of 32, got {c}")
    blocks = weight.float().view(r, c // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=E2M1_MAX * 2.0**-126)
    scale = pow2_ceil(amax / E2M1_MAX)
    codes = e2m1_encode(blocks / scale.unsqueeze(-1)).view(r, c)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, float_to_ue8m0(scale)


def fake_quant_fp8(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Per-row FP8-E4M3 quantise->dequantise in groups of `group` channels with power-of-two scales (Q8)."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // group, group)
    scale = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=1e-4) / E4M3_MAX)
    q = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(shape)


def fake_quant_fp4(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Per-row MXFP4 (E2M1, UE8M0 per `group`) quantise->dequantise."""
    shape = x.shape
    g = x.float().reshape(-1, shape[-1] // group, group)
    scale = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=E2M1_MAX * 2.0**-126) / E2M1_MAX)
    return (e2m1_decode(e2m1_encode(g / scale)) * scale).reshape(shape)
