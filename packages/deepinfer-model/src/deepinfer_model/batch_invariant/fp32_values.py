"""Which tensors hold only FP32-valued entries (at most 24 significant bits each), what the exact-product
paths need: the value test, and marks set by callers that know it without testing, guarded by the tensor's
in-place version counter (`version_of`, which guards the weight caches too)."""

from __future__ import annotations

import torch


def _fp32_valued(t: torch.Tensor) -> bool:
    """Every value of `t` has at most FP32's 24-bit significand (FP32 and BF16 values do)."""
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return True
    return bool(torch.equal(t.float().to(t.dtype), t))


def version_of(t: torch.Tensor) -> int | None:
    """`t`'s in-place version counter, or None for an inference tensor (made under `torch.inference_mode`,
    which keeps none: reading `_version` raises): caches and marks guarded by it skip such tensors."""
    if torch.compiler.is_compiling():  # a traced step cannot read versions: it keeps no marks or caches
        return None
    return None if t.is_inference() else t._version


# Key tensors known to hold FP32-valued entries (read from an FP32 / BF16 / FP8 cache pool), marked by
# the paged runtime where it reads them: checking every element costs as much as the fast paths save.
_FP32_MARK = "_deepinfer_fp32_valued"


def mark_fp32_valued(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` (returned) as holding only FP32-valued entries: the caller knows (e.g. it was read from an
    FP32 or narrower cache pool, or rounded to FP32 / BF16 by `numerics.round_to`). Derived tensors are
    not marked. The mark holds the tensor's in-place version: an in-place change afterwards (which may
    write other values) voids it. Inference tensors (made under `torch.inference_mode`) keep no version,
    so they are left unmarked (their values get tested where it matters)."""
    version = version_of(t)
    if version is not None:
        setattr(t, _FP32_MARK, version)
    return t


def marked_fp32_valued(t: torch.Tensor) -> bool:
    """Whether `t` itself was marked by `mark_fp32_valued` and not changed in place since."""
    mark = getattr(t, _FP32_MARK, None)
    return mark is not None and mark == version_of(t)
