"""The elementwise gate of Engram injection (spec v41-model §5.4), the `engram_gate` op's reference.

The model side (hashing, table lookup, the `kv` projection) is `models/deepseek_v41/engram.py`; this is what
follows the projection: per token `t` and stream `i`, a signed-sqrt sigmoid gate of the normalised dot product
of the trunk row `R[t, i]` and its key `k[t, i]` weighted by `qk[i]` (= q_weight * k_weight), and
`R[t, i] + g * v[t]` rounded once. Image tokens keep their trunk rows.
"""

from __future__ import annotations

import math

import torch

from ..numerics import carrier, round_to

GATE_CLAMP = 1e-6  # hard-coded floor of |dot| before the signed square root


def engram_gate(
    trunk: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qk: torch.Tensor,
    image: torch.Tensor,
    eps: float,
    act_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The trunk [T, m, H] after the gated update, in `out_dtype`: math in the carrier, one rounding to
    `act_dtype`; rows where `image` [T] is set are the trunk's as they are. `k` [T, m, H], `v` [T, H], `qk`
    [m, H] (FP32 values)."""
    hidden = trunk.shape[-1]
    x = trunk.to(carrier())
    k, v, qk = k.to(carrier()), v.to(carrier()), qk.to(carrier())
    dot = (x * k * qk).sum(-1)
    dot = (
        dot
        * torch.rsqrt(x.square().mean(-1) + eps)
        * torch.rsqrt(k.square().mean(-1) + eps)
        / math.sqrt(hidden)
    )
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=GATE_CLAMP).sqrt())
    out = round_to(x + gate.unsqueeze(-1) * v.unsqueeze(1), act_dtype)
    return torch.where(image[:, None, None], trunk.to(out.dtype), out).to(out_dtype)
