"""Batch-invariant mode (`DEEPINFER_BATCH_INVARIANT=1`) of the reference model, on the CPU and on CUDA.

Why the default CPU path is not invariant by construction: blocks accumulate in FP64 and round once
to FP32/BF16, but MKL's FP64 GEMM does not compute a row the same way for every number of rows M (the
M = 1 path is a GEMV, larger M use blocked kernels with other K-unrolling). The FP64 results then
differ in their last bits, and the rounding to FP32 hides that except when a value lies within a few
FP64 ulps of an FP32 rounding boundary (about 2^-28 of values). Rare, but not never.

What the mode changes: every `numerics.linear` / `numerics.logits` (all projections, experts, router,
LM head) and every `matmul` of the mode computes each row independently of the batch. On the CPU (FP64),
`row_gemm` picks a path per row from the row itself: a row of FP32/BF16 values (most GEMM inputs, the
LM head's included) goes through one plain GEMM with the weight as a cached row-major [K, N] operand
(zero columns up to a multiple of `COL_PAD`), where every product is exact and MKL gives the row the
same bits for every M, the M = 1 GEMV included, at any index (measured; see `exact_gemm`), so a decode
row costs a GEMV, not a padded tile; a row with more bits (the SwiGLU output) goes through
fixed tiles of `TILE_ROWS` rows against that weight (`tiled_matmul`). On other devices every row takes
the fixed tiles (the last tile zero-padded), so it goes through the same kernel with the same shape and
K order whatever the batch, the prefill chunk or the prefix-cache hit around it. Costs:
`benchmarks/repro/bench_batch_invariant.py` measures them.

Attention (`sink_attention`): keys in tiles of `KEY_TILE` columns aligned to a frame that depends on the
key only, every product a fixed-shape GEMM, tile partials added in tile order (`attention` says why and
how). Off the CPU every product goes through the backend's fixed-order ops (`fixed_bmm` says why).

Not changed (and why it is still invariant): norms, router top-k, quantisation and sampling reduce
within one row; the sampler draws from a keyed stream. The indexer's scores use the same tiled dot
products (`tiled_scores`). Not covered: the stateless `model.forward` keeps the default attention
(its FP64 results may differ from the paged runtime's in the last bits; FP32 logits agreed in every
test), and NVIDIA backend ops that bypass `numerics.linear` (the FP8 linears and grouped experts).

Modules, one idea each (this package re-exports what the rest of the engine uses):
- `switch`: whether the mode is on (`enabled`, `read_env`, the value pinned per step), `sync_free`;
- `fixed_bmm`: products whose bits do not depend on how many share a call (`bmm`, `tiled_matmul`);
- `fp32_values`: which tensors hold only FP32-valued entries (`mark_fp32_valued`, `version_of`);
- `cpu_gemm`: one CPU GEMM of exact products with a K order that does not depend on the row count;
- `weight_parts`: the cached FP64 operand copies of weights (`stacked_parts`, `PART_CACHE_BYTES`);
- `row_matmul`: row-invariant `x @ w` (`row_gemm`, `exact_gemm`, `matmul`, `device_rows`);
- `grouped`: rows grouped by expert times their group's weight (`grouped_gemm`);
- `key_layout`: where keys sit (`key_tiles`, `aligned_span`, `own_layout`, `own_order`);
- `tile_products`, `scores`, `own_keys`: the attention's tile products, scores and own-key partials;
- `attention_plan`: the (row tile, key tile) pairs a step's attention computes (`plan_attention`);
- `attention`, `exact_attention`: `sink_attention`, and its exact-score CPU paths.

A module-level setting or cache is read from the module that owns it, so a test changes it there (e.g.
`attention_plan.DENSE_FRACTION`, `key_layout.SHARED_ENTRY_COLS`, `weight_parts.PART_CACHE_BYTES`): the
names re-exported here are copies of their values.
"""

from __future__ import annotations

from .attention import sink_attention
from .attention_plan import DENSE_FRACTION, AttentionPlan, plan_attention
from .cpu_gemm import WIDE_BYTES
from .exact_attention import EXACT_BLOCK_QUERIES, PV_HALF_ROWS
from .fixed_bmm import DEVICE_BATCH, TILE_ROWS, bmm, chunked_bmm, gathered_chunked_bmm, tiled_matmul
from .fp32_values import mark_fp32_valued, marked_fp32_valued, version_of
from .grouped import grouped_gemm
from .key_layout import (
    KEY_TILE,
    OWN_COLS,
    SHARED_ENTRY_COLS,
    aligned_span,
    key_tiles,
    own_layout,
    own_order,
    shared_entry_cols,
)
from .row_matmul import device_rows, exact_gemm, matmul, row_gemm
from .scores import exact_scores_apply, row_scores, tiled_scores
from .switch import ENV, enabled, read_env, sync_free
from .weight_parts import COL_PAD, PART_CACHE_BYTES, stacked_parts

__all__ = [
    "COL_PAD",
    "DENSE_FRACTION",
    "DEVICE_BATCH",
    "ENV",
    "EXACT_BLOCK_QUERIES",
    "KEY_TILE",
    "OWN_COLS",
    "PART_CACHE_BYTES",
    "PV_HALF_ROWS",
    "SHARED_ENTRY_COLS",
    "TILE_ROWS",
    "WIDE_BYTES",
    "AttentionPlan",
    "aligned_span",
    "bmm",
    "chunked_bmm",
    "device_rows",
    "enabled",
    "exact_gemm",
    "exact_scores_apply",
    "gathered_chunked_bmm",
    "grouped_gemm",
    "key_tiles",
    "mark_fp32_valued",
    "marked_fp32_valued",
    "matmul",
    "own_layout",
    "own_order",
    "plan_attention",
    "read_env",
    "row_gemm",
    "row_scores",
    "shared_entry_cols",
    "sink_attention",
    "stacked_parts",
    "sync_free",
    "tiled_matmul",
    "tiled_scores",
    "version_of",
]
