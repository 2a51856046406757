"""Values read from a pool, marked for batch-invariant mode's exact-product score paths."""

from __future__ import annotations

import torch

from ... import batch_invariant
from ...runtime.pools import PagedKVCache


def mark_pool_values(cache: PagedKVCache, pool: str, x: torch.Tensor) -> torch.Tensor:
    """`x` (read from `pool`, zeros filled in) marked FP32-valued where the pool holds FP32 or narrower
    floats: batch-invariant mode's exact-product score paths (`batch_invariant.row_scores`) need that and
    checking every key would cost what they save."""
    dtype = cache.pools[pool].dtype
    if batch_invariant.enabled() and dtype.is_floating_point and dtype.itemsize <= 4:
        batch_invariant.mark_fp32_valued(x)
    return x
