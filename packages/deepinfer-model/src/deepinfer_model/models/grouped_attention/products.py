"""Native-mode batched products of attention: one matrix per sequence or one per query slot."""

from __future__ import annotations

import torch

from ...numerics import bmm_f32


def _shared_keys(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Native products against one matrix per sequence: x [G, b, h, i] @ m [G, i, j] -> FP32 [G, b, h, j]
    (one batched GEMM of b*h rows per sequence)."""
    gs, b, h, i = x.shape
    return bmm_f32(x.reshape(gs, b * h, i), m).view(gs, b, h, -1)


def _own_keys(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Native products against one matrix per query slot: x [G, b, h, i] @ m [G, b, i, j] -> FP32 [G, b, h, j]."""
    gs, b, h, i = x.shape
    return bmm_f32(x.reshape(gs * b, h, i), m.reshape(gs * b, i, -1)).view(gs, b, h, -1)
