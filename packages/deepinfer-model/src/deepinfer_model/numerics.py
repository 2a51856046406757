"""Rounding points of the CPU reference.

Blocks compute in FP64 and `round_to(x, act_dtype)` marks every place where the engine stores a value:
FP32 (the oracle setting) or BF16 (real checkpoints). Accumulating in FP64 and rounding to at most FP32
makes each row's result independent of how many rows are computed together (CPU GEMM blocking
changes FP32 sums with the batch shape), so a prefix forward, a decode step and a batched forward give
bitwise equal rows - the property the paged runtime is tested against.
"""

from __future__ import annotations

import weakref

import torch

from . import batch_invariant

# FP64 copies of weights, made once instead of on every call (converting the weights dominated the
# CPU step time). Keyed by the weight's id, guarded by a weak reference to it (ids are reused after a
# tensor dies) and by its in-place version counter, so an in-place update (e.g. an EPLB weight
# shuffle) is never served a stale copy. Tensors compare elementwise, so they cannot be dict keys.
_FP64_WEIGHTS: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def weight_fp64(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as FP64, cached per tensor until the tensor is modified in place."""
    if weight.dtype == torch.float64:
        return weight
    key = id(weight)
    cached = _FP64_WEIGHTS.get(key)
    if cached is not None and cached[0]() is weight and cached[1] == weight._version:
        return cached[2]
    fp64 = weight.double()
    if cached is None or cached[0]() is not weight:
        weakref.finalize(weight, _FP64_WEIGHTS.pop, key, None)
    _FP64_WEIGHTS[key] = (weakref.ref(weight), weight._version, fp64)
    return fp64


def round_to(x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded (round-to-nearest-even) to `act_dtype` (FP32 or BF16), returned as FP64 for further math."""
    return x.to(act_dtype).double()


def linear(x: torch.Tensor, weight: torch.Tensor, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`x @ weight.T` accumulated in FP64, output rounded once to `act_dtype`."""
    # batch_invariant.matmul: plain `@`, or fixed row tiles under DEEPINFER_BATCH_INVARIANT=1
    return round_to(batch_invariant.matmul(x.double(), weight_fp64(weight).t()), act_dtype)
