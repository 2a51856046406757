"""Registry ops in the reference blocks' calling convention, for the model's call sites.

The model computes in FP64 tensors whose values are already rounded to the activation dtype (see
`numerics.round_to`). These wrappers pass such a tensor unchanged to the op of the backend that owns
its device (CPU tensors: the `cpu` table, always; CUDA tensors: `get_ops()`), ask for the output
rounded once to `act_dtype`, and hand back FP64 again. The `cpu` entries are the reference blocks
themselves, so a CPU forward is bitwise what it was before the registry existed.
"""

from __future__ import annotations

import torch

from .. import batch_invariant
from ..numerics import carrier, narrow_act
from .registry import OpTable, get_ops


def _carry(y: torch.Tensor) -> torch.Tensor:
    """An op's `act_dtype` output in the carrier dtype; in batch-invariant mode a widened FP32 / BF16
    output is marked FP32-valued (`batch_invariant.mark_fp32_valued`: its GEMMs skip testing every value)."""
    out = y.to(carrier())
    if out is not y and y.dtype.is_floating_point and y.dtype.itemsize <= 4 and batch_invariant.enabled():
        batch_invariant.mark_fp32_valued(out)
    return out


def ops_for(x: torch.Tensor) -> OpTable:
    """The op table that serves tensors on `x`'s device."""
    return get_ops("cpu") if x.device.type == "cpu" else get_ops()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, act_dtype: torch.dtype, narrow: bool = False
) -> torch.Tensor:
    """`layers.norm.rms_norm` through the registry (`narrow`: the op's act-dtype output as it is where
    `numerics.narrow_act(act_dtype)`, for callers whose every consumer takes it)."""
    y = ops_for(x).rms_norm(x, weight, eps, out_dtype=act_dtype)
    return y if narrow and narrow_act(act_dtype) else _carry(y)


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    act_dtype: torch.dtype,
    inverse: bool = False,
    narrow: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    """`round_to(apply_rope(x, cos, sin, inverse), act_dtype)` through the registry (`narrow`: the op's
    act-dtype output as it is where `numerics.narrow_act(act_dtype)`).

    `inplace`: the caller hands `x` over (a tensor of its own whose value it does not need after the call).
    Where the result would be an `act_dtype` tensor and `x` already is one (native mode: `narrow` with BF16
    activations, or FP32 activations), contiguous, the op `apply_rope_` rotates its last r channels in place
    (only they are read and written, the same values) and `x` is returned; else as without it. Only where
    the table serves `apply_rope_` from the backend that serves `apply_rope` (not the cpu reference standing
    in for a missing kernel on a GPU: other arithmetic)."""
    table = ops_for(x)
    if inplace and x.dtype == act_dtype and (x.dtype == carrier() or narrow and narrow_act(act_dtype)):
        if _serves_in_place(table) and in_place_problem(x, cos, sin) is None:
            table.apply_rope_(x, cos, sin, inverse)
            return x
    y = table.apply_rope(x, cos, sin, inverse, out_dtype=act_dtype)
    return y if narrow and narrow_act(act_dtype) else _carry(y)


def _serves_in_place(table: OpTable) -> bool:
    return table.sources.get("apply_rope_") == table.sources.get("apply_rope")


def hc_mixes(
    trunk: torch.Tensor, params, hc_eps: float, rms_eps: float, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layers.mhc.mixes(trunk, params, ...)` through the registry (FP32 values, returned as FP64). In
    batch-invariant mode every backend keeps each token's result independent of the others (the NVIDIA
    op projects through the Triton row kernels there, see `backends/nvidia/tilelang_mhc.py`)."""
    table = ops_for(trunk)
    pre, post, comb = table.hc_mixes(trunk, params.fn, params.base, params.scale, hc_eps, rms_eps, iters)
    return pre.to(carrier()), post.to(carrier()), comb.to(carrier())


def hc_mixes_read(
    trunk: torch.Tensor,
    params,
    hc_eps: float,
    rms_eps: float,
    iters: int,
    read_weights: torch.Tensor,
    act_dtype: torch.dtype,
    narrow: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_mixes(trunk, params, ...)` and `hc_read(trunk, read_weights, act_dtype, narrow)` as one registry op
    (one pass over the trunk where the backend can)."""
    table = ops_for(trunk)
    pre, post, comb, y = table.hc_mixes_read(
        trunk, params.fn, params.base, params.scale, hc_eps, rms_eps, iters, read_weights, act_dtype
    )
    y = y if narrow and narrow_act(act_dtype) else _carry(y)
    return pre.to(carrier()), post.to(carrier()), comb.to(carrier()), y


def hc_read(
    trunk: torch.Tensor, weights: torch.Tensor, act_dtype: torch.dtype, narrow: bool = False
) -> torch.Tensor:
    """`mhc.read` through the registry (`narrow`: the act-dtype output as it is where `narrow_act`)."""
    y = ops_for(trunk).hc_read(trunk, weights, out_dtype=act_dtype)
    return y if narrow and narrow_act(act_dtype) else _carry(y)


def hc_write(
    y: torch.Tensor,
    trunk: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    act_dtype: torch.dtype,
    narrow: bool = False,
) -> torch.Tensor:
    """`mhc.write` through the registry (`narrow`: the new trunk in the act dtype where `narrow_act`)."""
    out = ops_for(trunk).hc_write(y, trunk, post, comb, out_dtype=act_dtype)
    return out if narrow and narrow_act(act_dtype) else _carry(out)


def engram_gate(
    trunk: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qk: torch.Tensor,
    image: torch.Tensor,
    eps: float,
    act_dtype: torch.dtype,
    narrow: bool = False,
) -> torch.Tensor:
    """`layers.engram.engram_gate` through the registry: the trunk after the Engram update, in the carrier
    dtype (`narrow`: in the act dtype where `narrow_act(act_dtype)` and the trunk given already is one, so
    that image rows, copied as they are, keep their values)."""
    narrowed = narrow and narrow_act(act_dtype) and trunk.dtype == act_dtype
    out_dtype = act_dtype if narrowed else carrier()
    return ops_for(trunk).engram_gate(trunk, k, v, qk, image, eps, act_dtype, out_dtype)


def grouped_expert_mlp(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts,
    limit: float,
    weight_before_down: bool = False,
) -> torch.Tensor:
    """The routed part of `layers.experts.experts_forward` for experts in the FP8 block layout
    (`quant_sm90.Fp8Experts`, converted from MXFP4 at load time): FP64 [T, H], the FP32 sum over slots,
    not yet rounded (the caller adds the shared expert, then rounds once)."""
    out = ops_for(x).grouped_expert_mlp(
        x, weights.float(), ids, experts.w13, experts.s13, experts.w2, experts.s2, limit, weight_before_down
    )
    return out.to(carrier())


def fused_kernel(name: str, x: torch.Tensor, *shape: int):
    """The backend's op `name` (`sparse_prefill_attention`, `index_scores`) for tensors on `x`'s device when
    a kernel serves this shape (its `supports(*shape)`), else None. These ops replace a longer torch path
    of the caller; their `cpu` reference is a plain gather / loop, slower than that path, so it is never
    chosen for speed (the caller keeps its own path)."""
    table = ops_for(x)
    if table.sources.get(name, "cpu") == "cpu":
        return None
    fn = table[name]
    supports = getattr(fn, "supports", None)
    return fn if supports is None or supports(*shape) else None


# Last: importing `layers` runs its package, whose attention module imports this one's ops above; a
# top-level import of it before they are defined is a cycle when this module is imported first.
from ..layers.rope import in_place_problem  # noqa: E402
