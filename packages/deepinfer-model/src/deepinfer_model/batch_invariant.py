"""Batch-invariant mode of the CPU reference (`DEEPINFER_BATCH_INVARIANT=1`).

Why the default CPU path is not invariant by construction: blocks accumulate in FP64 and round once
to FP32/BF16, but MKL's FP64 GEMM does not compute a row the same way for every number of rows M (the
M = 1 path is a GEMV, larger M use blocked kernels with other K-unrolling). The FP64 results then
differ in their last bits, and the rounding to FP32 hides that except when a value lies within a few
FP64 ulps of an FP32 rounding boundary (about 2^-28 of values). Rare, but not never.

What the mode changes: every `numerics.linear` (all projections, experts, router, LM head) runs as
GEMMs over fixed tiles of `TILE_ROWS` rows (the last tile zero-padded), so every row goes through the
same kernel with the same shape and K order whatever the batch, the prefill chunk or the prefix-cache
hit around it. Measured: a row's FP64 result in a fixed-shape tile does not depend on its neighbours
or its index in the tile (`tests/test_repro_batch_invariance.py`). Costs: decode rows pay for a full
tile (cheap: the weight's FP64 conversion dominates), long prefills lose the big-GEMM blocking
(`benchmarks/repro/bench_batch_invariant.py` measures it).

Not changed (and why it is still invariant): norms, router top-k, quantisation and sampling reduce
within one row; the sampler draws from a keyed stream. Attention in the paged runtime batches
sequences into padded groups: its FP64 softmax / P·V sums see padding that depends on the group, so
they share the last-bit caveat above (no flip seen in the tests); a strict fix belongs in
`deepinfer_model.runtime.groups` (reduce over each sequence's own key count).
"""

from __future__ import annotations

import os

import torch

ENV = "DEEPINFER_BATCH_INVARIANT"
TILE_ROWS = 8


def enabled() -> bool:
    """Read at every call (like `deepinfer.envs`), so tests and benchmarks may flip it at run time."""
    return os.environ.get(ENV, "") not in ("", "0", "false", "False")


def tiled_matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`x @ w_t` for 2-D `x` [M, K], computed as fixed [TILE_ROWS, K] @ [K, N] products (one bmm)."""
    m, k = x.shape
    pad = (-m) % TILE_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    tiles = x.reshape(-1, TILE_ROWS, k)
    # bmm runs one GEMM per tile (the weight is broadcast, not copied); a 3-D @ 2-D matmul would be
    # folded back into one [M, K] GEMM, which is exactly what must not happen.
    out = torch.bmm(tiles, w_t.unsqueeze(0).expand(tiles.shape[0], -1, -1))
    return out.reshape(-1, w_t.shape[1])[:m]


def matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`x @ w_t` over the last dim of `x` (any leading dims); row-invariant when the mode is on."""
    if not enabled():
        return x @ w_t
    lead = x.shape[:-1]
    return tiled_matmul(x.reshape(-1, x.shape[-1]), w_t).reshape(*lead, w_t.shape[1])
