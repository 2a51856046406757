"""Every master's stored value in a handful of batched ops, bitwise equal to `trainable.stored_value`.

`stored_value` quantises one tensor at a time: ~60 small ops per FP4 expert matrix and a device-to-host
read per FP8 / FP4 tensor (the UE8M0 round trip's check). The tiny model has ~700 tensors, so that was
~25,000 of the ~48,000 ops of a training micro-step, each a kernel launch on the GPU. The values here
come from the same arithmetic on groups of tensors: all BF16 tensors in one rounding, all MXFP4 tensors
(whose 32-element blocks run along rows, so concatenated rows keep their blocks) in one, the FP8 tensors
stacked per shape. No quantised bytes are made: the dequantised value is `q * scale` with the same power
of two scale `quant_*` would store (every scale lies inside UE8M0's range, so the byte round trip is exact).
"""

from __future__ import annotations

import torch
from deepinfer_model.training import BF16, E4M3_MAX, F32, FP4, FP8, FP8_ROWS, fake_quant_fp4, pow2_ceil


@torch.no_grad()
def grouped_stored_values(
    masters: dict[str, torch.Tensor], kinds: dict[str, str], block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """{name: stored value} (detached FP32) of each tensor of `masters`, `kinds[name]` its storage kind.
    FP32 tensors are returned as they are (detached views of the masters)."""
    out: dict[str, torch.Tensor] = {}
    by_kind: dict[str, list[str]] = {}
    for name in masters:
        kind = kinds[name]
        if kind not in (F32, BF16, FP4, FP8, FP8_ROWS):
            raise ValueError(f"unknown storage kind {kind!r} of {name}")
        by_kind.setdefault(kind, []).append(name)
    for name in by_kind.get(F32, []):
        out[name] = masters[name].detach()
    bf16 = by_kind.get(BF16, [])
    if bf16:
        flat = torch.cat([masters[n].detach().reshape(-1) for n in bf16]).to(torch.bfloat16).float()
        out.update(_split(flat, bf16, masters))
    fp4 = by_kind.get(FP4, [])
    if fp4:
        flat = torch.cat([masters[n].detach().reshape(-1) for n in fp4])
        out.update(_split(fake_quant_fp4(flat.view(-1, 32)).view(-1), fp4, masters))
    by_shape: dict[tuple, list[str]] = {}
    for kind in (FP8, FP8_ROWS):
        for name in by_kind.get(kind, []):
            b = (1, 32) if kind == FP8_ROWS else tuple(block)
            by_shape.setdefault((tuple(masters[name].shape), b), []).append(name)
    for (_shape, b), names in by_shape.items():
        values = fp8_block_values(torch.stack([masters[n].detach() for n in names]), b)
        out.update(zip(names, values.unbind(0), strict=True))
    return {n: out[n] for n in masters}


def _split(flat: torch.Tensor, names: list[str], masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    parts = flat.split([masters[n].numel() for n in names])
    return {n: p.view(masters[n].shape) for n, p in zip(names, parts, strict=True)}


def fp8_block_values(stack: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`dequant_fp8_block(*quant_fp8_block(w, block), block)` of each `w` of `stack` [N, R, C]."""
    n, r, c = stack.shape
    b0, b1 = block
    nr, nc = -(-r // b0), -(-c // b1)
    padded = stack.new_zeros(n, nr * b0, nc * b1)
    padded[:, :r, :c] = stack
    blocks = padded.view(n, nr, b0, nc, b1)
    amax = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-4)
    scale = pow2_ceil(amax / E4M3_MAX)[:, :, None, :, None]
    q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).view(n, nr * b0, nc * b1)[:, :r, :c]
