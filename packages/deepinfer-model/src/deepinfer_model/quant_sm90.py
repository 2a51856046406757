"""MXFP4 routed experts -> the FP8 block layout DeepGEMM multiplies on Hopper (SM90), at load time.

Hopper has no FP4 tensor cores, so the routed experts (MXFP4: E2M1 values, one UE8M0 scale per 1x32
group along K) are converted once to FP8-E4M3 with one FP32 power-of-two scale per 128x128 block,
the layout of DeepGEMM's SM90 `m_grouped_fp8_gemm_nt_contiguous`. Pure torch, runs where its input
lives (CPU or CUDA).

Block scale rule. For a 128x128 block with largest magnitude `amax`, the scale is the smallest power
of two `2^b` with `amax / 2^b <= 448` (the usual FP8 block rule, `quant.quant_fp8_block`). Every value
of the block is `v * 2^e` (v an E2M1 magnitude in {.5, 1, 1.5, 2, 3, 4, 6}, `2^e` its group's scale) and
is stored as `q = v * 2^(e - b)`. An E2M1 value has at most two significant bits, E4M3 keeps four, so
q is exact unless it overflows (ruled out by the choice of b) or falls below E4M3's subnormal step
2^-9: exact iff every nonzero value's lowest set bit is >= 2^(b - 9).

* Sufficient condition on the scales alone: the block's group exponents span at most 14
  (`e_max - e_min <= 14`). Proof: b <= e_max - 6 (6 * 2^(e_max - 6) = 384 <= 448) and the lowest bit of
  any value is >= 2^(e_min - 1) (v = 0.5 or 1.5), so 2^(e_min - 1) >= 2^(b - 9) holds whenever
  e_min - 1 >= e_max - 15. It is tight: a group at e_max holding 6 next to one at e_max - 15 holding 0.5
  needs 2^-10, one step below E4M3's smallest subnormal.
* Wider spans: the large values stay exact (b is set by amax), the small ones round to nearest-even
  on the grid 2^(b - 9); the absolute error per value is at most 2^(b - 10) < amax / (224 * 2^10),
  i.e. below 4.4e-6 of the block's largest magnitude. `Fp8ConversionStats` counts such blocks.

Memory: MXFP4 costs 0.5 B/param + 1 B per 32 params = 0.53125 B/param; the FP8 layout 1 B/param + 4 B
per 128 x 128 = 16,384 params = 1.000244 B/param: 1.883x the bytes of the FP4 experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer_cluster import envs

FP8_BLOCK = 128
E4M3_MAX = 448.0
MXFP4_GROUP = 32
# Largest UE8M0 byte whose values (up to 6 * 2^(byte - 127)) still fit FP32 exactly: 6 * 2^125 < 2^128.
MAX_SCALE_BYTE = 252
ENV = "DEEPINFER_FP8_EXPERTS"


def fp8_experts_enabled() -> bool:
    """`DEEPINFER_FP8_EXPERTS=1`: the loaders convert MXFP4 routed experts to `Fp8Experts` and
    `experts_forward` runs them through the `grouped_expert_mlp` op (with its Q8 activation steps), on
    the CPU as on the GPU, so a GPU run can be compared with a CPU run of the same numerics. Read when a
    model is loaded; unset, empty or 0 = off (the default). ValueError on any other value."""
    return envs.get(ENV)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class Fp8ConversionStats:
    """How exactly a block-FP8 tensor reproduces its source values (FP64 comparison)."""

    blocks: int = 0
    inexact_blocks: int = 0
    inexact_values: int = 0
    max_abs_err: float = 0.0
    max_err_over_block_amax: float = 0.0  # worst |error| / (largest |value| of that block)

    def merge(self, other: Fp8ConversionStats) -> Fp8ConversionStats:
        return Fp8ConversionStats(
            self.blocks + other.blocks,
            self.inexact_blocks + other.inexact_blocks,
            self.inexact_values + other.inexact_values,
            max(self.max_abs_err, other.max_abs_err),
            max(self.max_err_over_block_amax, other.max_err_over_block_amax),
        )


def _blocks(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """[..., N, K] -> zero-padded [..., ceil(N/b), b, ceil(K/b), b] view."""
    *lead, n, k = x.shape
    nr, nc = -(-n // block), -(-k // block)
    if (nr * block, nc * block) != (n, k):
        x = torch.nn.functional.pad(x, (0, nc * block - k, 0, nr * block - n))
    return x.reshape(*lead, nr, block, nc, block)


def fp8_block_quant_pow2(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32/BF16 [..., N, K] -> (e4m3 [..., N, K], FP32 power-of-two scales [..., ceil(N/128), ceil(K/128)]).

    Per 128x128 block the smallest power of two `s` with amax / s <= 448 (all-zero blocks: s = 1), then
    q = RNE_e4m3(w / s). Exact for MXFP4-derived values under the rule in the module docstring.
    """
    if weight.dim() < 2:
        raise ValueError(f"fp8_block_quant_pow2: weight must be [..., N, K], got shape {tuple(weight.shape)}")
    if not weight.dtype.is_floating_point or weight.dtype.itemsize < 2:
        raise ValueError(f"fp8_block_quant_pow2: weight must be float32/bfloat16/float16, got {weight.dtype}")
    *lead, n, k = weight.shape
    blk = _blocks(weight.float())
    amax = blk.abs().amax(dim=(-3, -1))
    mant, exp = torch.frexp(amax / E4M3_MAX)
    scale = torch.ldexp(torch.ones_like(amax), torch.where(mant == 0.5, exp - 1, exp))
    # amax / 448 is rounded in FP32; where that rounding hid a value just above a power of two, go one up
    scale = torch.where(amax > scale * E4M3_MAX, scale * 2, scale)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = (blk / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, blk.shape[-4] * FP8_BLOCK, blk.shape[-2] * FP8_BLOCK)[..., :n, :k]
    return q.contiguous(), scale.contiguous()


def dequant_fp8_block_pow2(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Inverse of `fp8_block_quant_pow2` (exact in FP32/FP64): [..., N, K] in `dtype`."""
    *lead, n, k = q.shape
    blk = _blocks(q.to(dtype))
    out = blk * scale.to(dtype)[..., :, None, :, None]
    return out.reshape(*lead, blk.shape[-4] * FP8_BLOCK, blk.shape[-2] * FP8_BLOCK)[..., :n, :k]


def fp8_block_error(reference: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> Fp8ConversionStats:
    """Compare the FP8 blocks (`q`, `scale`) with the values they stand for (`reference`), in FP64."""
    ref = reference.double()
    err = (dequant_fp8_block_pow2(q, scale) - ref).abs()
    err_b, ref_b = _blocks(err), _blocks(ref.abs())
    block_err = err_b.amax(dim=(-3, -1))
    block_amax = ref_b.amax(dim=(-3, -1))
    ratio = torch.where(block_amax > 0, block_err / block_amax.clamp(min=1e-300), block_err)
    return Fp8ConversionStats(
        blocks=block_err.numel(),
        inexact_blocks=int((block_err > 0).sum()),
        inexact_values=int((err > 0).sum()),
        max_abs_err=float(err.max()) if err.numel() else 0.0,
        max_err_over_block_amax=float(ratio.max()) if ratio.numel() else 0.0,
    )


def _check_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(
            f"mxfp4_to_fp8_block: packed must be int8/uint8 (two E2M1 codes per byte), got {packed.dtype}"
        )
    if packed.dim() < 2:
        raise ValueError(f"mxfp4_to_fp8_block: packed must be [..., N, K/2], got shape {tuple(packed.shape)}")
    k = 2 * packed.shape[-1]
    if k % MXFP4_GROUP or k == 0:
        raise ValueError(
            f"mxfp4_to_fp8_block: K = 2 * packed.shape[-1] = {k} must be a positive multiple of {MXFP4_GROUP}"
        )
    want = (*packed.shape[:-1], k // MXFP4_GROUP)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"mxfp4_to_fp8_block: scale must have shape {list(want)} (one per 1x{MXFP4_GROUP} group of the "
            f"packed [..., N, K/2] = {list(packed.shape)}), got {list(scale.shape)}"
        )
    if scale.device != packed.device:
        raise ValueError(f"mxfp4_to_fp8_block: packed on {packed.device} but scale on {scale.device}")


def _scale_fp32(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 (float8_e8m0fnu / uint8) or float group scales -> FP32, refusing values FP32 cannot carry."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        e = scale.view(torch.uint8).to(torch.int32)
        worst = int(e.max()) if e.numel() else 0
        if worst > MAX_SCALE_BYTE:
            raise ValueError(
                f"mxfp4_to_fp8_block: UE8M0 scale byte {worst} out of range (allowed 0..{MAX_SCALE_BYTE}; "
                "255 is NaN, above 252 the values overflow FP32)"
            )
        return torch.ldexp(torch.ones(e.shape, device=e.device), e - 127)
    if not scale.dtype.is_floating_point:
        raise ValueError(
            f"mxfp4_to_fp8_block: scale must be float8_e8m0fnu, uint8 or float, got {scale.dtype}"
        )
    s = scale.float()
    if not bool((torch.isfinite(s) & (s > 0) & (s <= 2.0**125)).all()):
        raise ValueError("mxfp4_to_fp8_block: float scales must be finite and in (0, 2^125]")
    return s


def mxfp4_dequant_fp32(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 [..., N, K/2] + scales [..., N, K/32] -> FP32 [..., N, K], exact, on packed's device."""
    _check_mxfp4(packed, scale)
    b = packed.view(torch.uint8)
    table = torch.tensor(_E2M1, dtype=torch.float32, device=b.device)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # low nibble = even column
    values = table[codes.long()]
    s = _scale_fp32(scale)
    return (values.unflatten(-1, (-1, MXFP4_GROUP)) * s.unsqueeze(-1)).flatten(-2)


def mxfp4_to_fp8_block(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 [..., N, K/2] (+ UE8M0 scales [..., N, K/32]) -> (e4m3 [..., N, K], FP32 [..., ceil(N/128), ceil(K/128)]).

    Exact (dequantised values equal `quant.dequant_mxfp4`'s) for every block whose group scales span
    <= 14 binades; see the module docstring for the rule and the error bound beyond that.
    """
    return fp8_block_quant_pow2(mxfp4_dequant_fp32(packed, scale))


@dataclass
class Fp8Experts:
    """Routed experts in DeepGEMM's SM90 layout: `w13` [E, 2I, H] e4m3 (rows < I: w1 = gate, rows >= I:
    w3 = up), `s13` [E, 2I/128, ceil(H/128)] FP32; `w2` [E, H, I] e4m3, `s2` [E, ceil(H/128), I/128]
    FP32. I is the checkpoint's intermediate size rounded up to a multiple of 128 (zero padding).
    `stats`: how exactly the conversion kept the source values (None if not checked)."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    stats: Fp8ConversionStats | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2))


def fp8_experts_from_mxfp4(
    w1: tuple[torch.Tensor, torch.Tensor],
    w3: tuple[torch.Tensor, torch.Tensor],
    w2: tuple[torch.Tensor, torch.Tensor],
    check: bool = True,
) -> Fp8Experts:
    """Stacked MXFP4 experts (`(packed, scale)` of w1, w3 [E, I, H/2] and w2 [E, H, I/2]) -> `Fp8Experts`.

    w1 and w3 are joined along N before the conversion (one grouped GEMM for gate and up). `check`
    also measures the conversion error (`stats`) against the exact dequantised values.
    """
    for name, (p, s) in (("w1", w1), ("w3", w3), ("w2", w2)):
        if p.dim() != 3:
            raise ValueError(
                f"fp8_experts_from_mxfp4: {name} packed must be [E, N, K/2], got {tuple(p.shape)}"
            )
        _check_mxfp4(p, s)
    if w1[0].shape != w3[0].shape:
        raise ValueError(
            f"fp8_experts_from_mxfp4: w1 {tuple(w1[0].shape)} and w3 {tuple(w3[0].shape)} differ"
        )
    e, i, h2 = w1[0].shape
    if tuple(w2[0].shape) != (e, 2 * h2, i // 2):
        raise ValueError(
            f"fp8_experts_from_mxfp4: w2 packed must be [E, H, I/2] = {[e, 2 * h2, i // 2]}, got {list(w2[0].shape)}"
        )
    return _from_values(mxfp4_dequant_fp32(*w1), mxfp4_dequant_fp32(*w3), mxfp4_dequant_fp32(*w2), check)


def _from_values(v1: torch.Tensor, v3: torch.Tensor, v2: torch.Tensor, check: bool) -> Fp8Experts:
    """Exact FP32 values of w1, w3 [E, I, H] and w2 [E, H, I] -> `Fp8Experts`.

    I is zero-padded to a multiple of 128 (gate/up rows, down columns): the padded channels give
    h = silu(0) * 0 = 0 and multiply zero weights, so the function is unchanged while every 1x128
    activation group of h and every weight block stays within one expert's gate or up half.
    """
    pad = -v1.shape[-2] % FP8_BLOCK
    if pad:
        v1 = torch.nn.functional.pad(v1, (0, 0, 0, pad))
        v3 = torch.nn.functional.pad(v3, (0, 0, 0, pad))
        v2 = torch.nn.functional.pad(v2, (0, pad))
    v13 = torch.cat((v1, v3), dim=-2)
    q13, s13 = fp8_block_quant_pow2(v13)
    q2, s2 = fp8_block_quant_pow2(v2)
    stats = fp8_block_error(v13, q13, s13).merge(fp8_block_error(v2, q2, s2)) if check else None
    return Fp8Experts(q13, s13, q2, s2, stats)


def fp8_experts_from_weights(experts, check: bool = True) -> Fp8Experts:
    """`layers.experts.ExpertWeights` already dequantised (w1, w3 [E, I, H], w2 [E, H, I]; FP32 or BF16)
    -> `Fp8Experts`, on the weights' device.

    For experts loaded from MXFP4 this is bit-for-bit what `fp8_experts_from_mxfp4` gives (the loader's
    dequantisation is exact in FP32 and BF16: E2M1 values have two significant bits), so a loader that
    already dequantised can convert afterwards; `stats` says whether any value was not kept exactly.
    """
    w1, w3, w2 = experts.w1, experts.w3, experts.w2
    if (
        w1.dim() != 3
        or w1.shape != w3.shape
        or w2.dim() != 3
        or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1])
    ):
        raise ValueError(
            "fp8_experts_from_weights: expected w1, w3 [E, I, H] and w2 [E, H, I], got "
            f"{tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)}"
        )
    return _from_values(w1.float(), w3.float(), w2.float(), check)


def refuse_with_expert_parallelism(where: str) -> None:
    """Expert parallelism (`parallel.ep_moe`) computes per physical slot from `ExpertWeights` and EPLB
    shuffles those tensors in place: it has no `Fp8Experts` path. Raise instead of silently running (or
    failing on) the other numerics."""
    if fp8_experts_enabled():
        raise ValueError(
            f"{ENV}=1 cannot be combined with expert parallelism ({where}): the EP MoE runs dequantised "
            f"ExpertWeights only; unset {ENV} (or set it to 0), or run without expert parallelism"
        )
