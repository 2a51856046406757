"""Every (row tile, key tile) product of the attention as one fixed-shape GEMM: per tile, skipping those no
row sees (the CPU), or as one gathered list with cached index tensors (off the CPU); the same bits."""

from __future__ import annotations

import numpy as np
import torch

from .fixed_bmm import TILE_ROWS, _pad0, _products, bmm


def _row_tiles(x: torch.Tensor) -> torch.Tensor:
    """[B, R, C] -> [B, ceil(R / TILE_ROWS), TILE_ROWS, C] (zero rows appended)."""
    b, r, c = x.shape
    return _pad0(x, (-r) % TILE_ROWS, dim=1).view(b, -1, TILE_ROWS, c)


def _tile_products(
    a: torch.Tensor, b: torch.Tensor, seen: np.ndarray | None = None, batched: bool | None = None
) -> torch.Tensor:
    """All products a[i, r, t] @ b[i, t]: a [B, R, Ta, m, k] (Ta = T, or 1 = the same for every t),
    b [B, T, k, n] -> [B, R, T, m, n]. Every product is one [m, k] x [k, n] GEMM of contiguous
    matrices; calls loop over (the smaller of B and R) x T and batch the larger, with the shared
    operand broadcast (never copied). A product does not depend on how it was batched (tested).

    `seen` (bool [B, R, T] on the host, optional): which products can matter. Per call only the
    contiguous hull of the batched index where `seen` holds is computed; the rest stay exact +0, which
    is also what a GEMM gives for them (an all-zero P tile times any keys: every product is ±0, summed
    from +0 -> +0; a masked score is replaced by -inf anyway), so skipping them changes no bit. This is
    the band restriction of the sliding window: a query row tile computes only the key tiles it sees.

    `batched` (default: off the CPU, where the step is launch-bound): every product, `seen` or not, goes
    into one gathered product list (`_tile_products_batched`) instead of one call per tile; an unseen
    product is masked to -inf (scores) or is the +0 of an all-zero P tile (P.V), so computing it changes
    no bit; every product is still one fixed [m, k] x [k, n] GEMM."""
    if batched is None:
        batched = a.device.type != "cpu"
    if batched:  # every product, `seen` or not: an unseen one is masked (scores) or +0 (P.V) anyway
        return _tile_products_batched(a, b)
    bsz, r_count, ta = a.shape[:3]
    t_count = b.shape[1]
    alloc = a.new_empty if seen is None else a.new_zeros
    out = alloc(bsz, r_count, t_count, a.shape[-2], b.shape[-1])
    for t in range(t_count):
        at = min(t, ta - 1)
        if r_count >= bsz:
            for i in range(bsz):
                lo, hi = _hull(None if seen is None else seen[i, :, t], r_count)
                if hi > lo:
                    out[i, lo:hi, t] = bmm(a[i, lo:hi, at], b[i, t].expand(hi - lo, -1, -1))
        else:
            for r in range(r_count):
                lo, hi = _hull(None if seen is None else seen[:, r, t], bsz)
                if hi > lo:
                    out[lo:hi, r, t] = bmm(a[lo:hi, r, at], b[lo:hi, t])
    return out


def _tile_products_batched(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every product of `_tile_products` (same shapes, same results) as one gathered product list
    (`_products`): product (i, r, t) = a[i, r, min(t, Ta - 1)] @ b[i, t], indexed into the flat operands
    (no expanded copies where the backend gathers in its kernel)."""
    bsz, r_count, ta, m, k = a.shape
    t_count, n = b.shape[1], b.shape[-1]
    ia, ib = _product_indices(bsz, r_count, ta, t_count, a.device)
    out = _products(a.reshape(-1, m, k), b.reshape(-1, k, n), ia, ib)
    return out.view(bsz, r_count, t_count, m, n)


# (B, R, Ta, T, device) -> the index tensors of `_tile_products_batched`: functions of the shapes only, made
# once on the host (a decode step would otherwise launch ~8 small kernels per call to build them). Inside a
# CUDA-graph capture nothing is copied from the host: a cached entry (the warm-up run before a capture
# fills the cache for its shapes) is moved to `_CAPTURED_INDICES`, which is never evicted (the graph reads
# that memory at every replay); a missing one is made on the device, in the graph's own pool.
_PRODUCT_INDICES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_CAPTURED_INDICES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
PRODUCT_INDEX_CACHE = 512  # entries of `_PRODUCT_INDICES` before it is emptied (prefill shapes vary)


def _product_indices(bsz: int, r_count: int, ta: int, t_count: int, dev: torch.device):
    key = (bsz, r_count, ta, t_count, dev)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    hit = _CAPTURED_INDICES.get(key) or _PRODUCT_INDICES.get(key)
    if hit is not None:
        if capturing:
            _CAPTURED_INDICES[key] = hit
        return hit
    xp = (lambda n: torch.arange(n, device=dev)) if capturing else np.arange
    i, r, t = xp(bsz), xp(r_count), xp(t_count)
    t_a = t.clip(max=ta - 1) if capturing else np.minimum(t, ta - 1)
    ia = ((i[:, None, None] * r_count + r[None, :, None]) * ta + t_a[None, None, :]).reshape(-1)
    ib = (i[:, None, None] * t_count + t[None, None, :] + 0 * r[None, :, None]).reshape(-1)
    if capturing:
        return ia, ib
    out = (torch.from_numpy(ia).to(dev), torch.from_numpy(ib).to(dev))
    if len(_PRODUCT_INDICES) >= PRODUCT_INDEX_CACHE:
        _PRODUCT_INDICES.clear()
    _PRODUCT_INDICES[key] = out
    return out


def _hull(flags: np.ndarray | None, n: int) -> tuple[int, int]:
    """[first, last + 1) of the true `flags` (all `n` when None; empty when none is true)."""
    if flags is None:
        return 0, n
    idx = np.flatnonzero(flags)
    return (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)
