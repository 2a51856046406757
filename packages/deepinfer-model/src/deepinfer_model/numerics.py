"""Rounding points of the CPU reference.

All math runs in FP32; `round_to(x, act_dtype)` marks a place where the engine stores the value in
the activation dtype (BF16 on real checkpoints). With `act_dtype=float32` there is no rounding at
all, which is how the model is compared against transformers.
"""

from __future__ import annotations

import torch


def round_to(x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """Return FP32 `x` rounded (round-to-nearest-even) through `act_dtype`."""
    x = x.float()
    if act_dtype == torch.float32:
        return x
    return x.to(act_dtype).float()


def linear(x: torch.Tensor, weight: torch.Tensor, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`x @ weight.T` with FP32 accumulation and one rounding of the output."""
    return round_to(x.float() @ weight.float().t(), act_dtype)
