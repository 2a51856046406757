"""Interleaved rotary position embedding on the trailing channels of a vector (base or YaRN).

Pairs are `(x[2i], x[2i+1])` of the last `spec.dim` channels; the leading channels are left alone.
"""

from __future__ import annotations

import functools
import math

import torch

from ..compile_boundary import as_custom_op, custom_ops_enabled, outside_compiled_graph
from ..config import RopeSpec, YarnScaling
from ..numerics import carrier


def inv_freq(spec: RopeSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """FP32 [dim/2] angular frequencies on `device`; YaRN blends interpolated and original ones with a
    linear ramp. Computed once per (spec, device), always on the host, so every device rotates by the
    same frequencies bit for bit."""
    return _inv_freq(spec, torch.device(device))


@outside_compiled_graph  # traced, the cache is skipped: a host-to-device copy in the graph
@functools.lru_cache(maxsize=64)
def _inv_freq(spec: RopeSpec, device: torch.device) -> torch.Tensor:
    return _host_inv_freq(spec).to(device)


def _host_inv_freq(spec: RopeSpec) -> torch.Tensor:
    dim = spec.dim
    base_freq = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    if spec.yarn is None:
        return base_freq
    y = spec.yarn

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(spec.theta))
        )

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    return (base_freq / y.factor) * ramp + base_freq * (1 - ramp)


def _inv_freq_copy(positions, theta, dim, factor, original, beta_fast, beta_slow, yarn):
    """A copy of `inv_freq(spec, positions.device)` for the spec given field by field (a custom op's arguments)."""
    scaling = YarnScaling(factor, original, beta_fast, beta_slow) if yarn else None
    return _inv_freq(RopeSpec(theta, dim, scaling), positions.device).clone()


def _inv_freq_fake(positions, theta, dim, factor, original, beta_fast, beta_slow, yarn):
    return positions.new_empty(dim // 2, dtype=torch.float32)


# Inside a compiled region the cached frequencies come from a custom op (a copy of the cached tensor: one small
# kernel) instead of a graph break at every RoPE table
_INV_FREQ_OP = (
    as_custom_op(
        "deepinfer::rope_inv_freq",
        _inv_freq_copy,
        "(Tensor positions, float theta, int dim, float factor, int original, float beta_fast, float beta_slow, "
        "bool yarn) -> Tensor",
        _inv_freq_fake,
    )
    if custom_ops_enabled()
    else None
)


def cos_sin(spec: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 cos/sin tables [len(positions), dim/2] (amplitude 1: DeepSeek-V4 applies no YaRN mscale)."""
    if _INV_FREQ_OP is not None and torch.compiler.is_compiling():
        y = spec.yarn or YarnScaling(1.0, 1)  # (placeholder fields where there is no YaRN)
        freqs = _INV_FREQ_OP(positions, float(spec.theta), int(spec.dim), float(y.factor),
                             int(y.original_max_position_embeddings), float(y.beta_fast), float(y.beta_slow),
                             spec.yarn is not None)  # fmt: skip
    else:
        freqs = inv_freq(spec, positions.device)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `2*cos.shape[-1]` channels of `x` [T, ..., C] by the angles of `cos/sin` [T, dim/2].

    `inverse=True` rotates by the negative angle (the conjugate rotation applied to attention outputs).
    Returns FP64.
    """
    x = x.to(carrier())
    half = cos.shape[-1]
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(view), sin.reshape(view)
    if inverse:
        s = -s
    tail = x[..., -2 * half :]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat((x[..., : -2 * half], rotated), dim=-1)


ROTATE_IN_PLACE_DTYPES = (torch.float32, torch.bfloat16)


def in_place_problem(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the op `apply_rope_` cannot rotate `x` in place, or None: it takes a contiguous FP32 / BF16
    `x` [T, ..., C] (its rows are addressed as the flat `[T * heads, C]`) and `cos` / `sin` [T, r/2] with
    r <= C. Every backend checks this one rule, so a CPU run rejects what a GPU run would."""
    if x.dtype not in ROTATE_IN_PLACE_DTYPES:
        return f"x must be float32 or bfloat16, got {x.dtype}"
    if x.dim() < 2:
        return f"x must be [T, ..., C], got shape {tuple(x.shape)}"
    if not x.is_contiguous():
        return f"x must be contiguous, got shape {tuple(x.shape)} with strides {x.stride()}"
    if (
        cos.shape != sin.shape
        or cos.dim() != 2
        or cos.shape[0] != x.shape[0]
        or 2 * cos.shape[1] > x.shape[-1]
    ):
        return (
            f"cos/sin must be [T={x.shape[0]}, r/2] with r <= {x.shape[-1]}, "
            f"got {tuple(cos.shape)} / {tuple(sin.shape)}"
        )
    return None


def check_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ValueError naming `in_place_problem`'s reason, if any: each backend's `apply_rope_` calls this first."""
    problem = in_place_problem(x, cos, sin)
    if problem is not None:
        raise ValueError(f"apply_rope_: {problem}")
