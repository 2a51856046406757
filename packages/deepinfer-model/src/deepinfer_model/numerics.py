"""Rounding points of the CPU reference.

Blocks compute in FP64 and `round_to(x, act_dtype)` marks every place where the engine stores a value:
FP32 (the oracle setting) or BF16 (real checkpoints). Accumulating in FP64 and rounding to at most FP32
makes each row's result independent of how many rows are computed together (CPU GEMM blocking
changes FP32 sums with the batch shape), so a prefix forward, a decode step and a batched forward give
bitwise equal rows - the property the paged runtime is tested against.
"""

from __future__ import annotations

import torch

from . import batch_invariant


def round_to(x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded (round-to-nearest-even) to `act_dtype` (FP32 or BF16), returned as FP64 for further math."""
    return x.to(act_dtype).double()


def linear(x: torch.Tensor, weight: torch.Tensor, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`x @ weight.T` accumulated in FP64, output rounded once to `act_dtype`."""
    # batch_invariant.matmul: plain `@`, or fixed row tiles under DEEPINFER_BATCH_INVARIANT=1
    return round_to(batch_invariant.matmul(x.double(), weight.double().t()), act_dtype)
