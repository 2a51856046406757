"""Quantise-dequantise of the V4.1 KV caches (spec v41-model §4.9, §10.6): what the engine stores is
what attention reads, so a cache-faithful reference must see the same rounded values.

* SWA latents and drafter keys: FP8-E4M3, one UE8M0 (power-of-two) scale per 32 values.
* Main compressed KV: FP4-E2M1 with one E4M3 scale per 16 values, `scale = e4m3(max(amax, 6·2^-9) / 6)`
  (or FP8 per 32 when `use_fp4_sparse_kv` is false).
* Index queries and keys: FP4-E2M1 with a UE8M0 scale per 32 values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...numerics import carrier
from ...quant import E2M1_MAX, e2m1_decode, e2m1_encode, fake_quant_fp4, fake_quant_fp8

_FP4_KV_GROUP = 16
_FP4_KV_MIN_AMAX = E2M1_MAX * 2.0**-9


def fake_quant_fp4_e4m3(x: torch.Tensor, group: int = _FP4_KV_GROUP) -> torch.Tensor:
    """FP4-E2M1 values with a non-power-of-two E4M3 scale per `group` channels (main KV format)."""
    shape = x.shape
    g = x.to(carrier()).reshape(-1, shape[-1] // group, group)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=_FP4_KV_MIN_AMAX)
    scale = (amax / E2M1_MAX).to(torch.float8_e4m3fn).to(carrier())
    return (e2m1_decode(e2m1_encode(g / scale)).to(carrier()) * scale).reshape(shape)


@dataclass(frozen=True)
class KVQuant:
    """Which cache roundings to simulate; `enabled=False` keeps every KV value exact."""

    enabled: bool = False
    fp4_main_kv: bool = True

    def swa(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp8(x, 32).to(x.dtype) if self.enabled else x

    def main(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        return (fake_quant_fp4_e4m3(x) if self.fp4_main_kv else fake_quant_fp8(x, 32)).to(x.dtype)

    def index(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp4(x, 32).to(x.dtype) if self.enabled else x


EXACT_KV = KVQuant()  # no cache rounding
