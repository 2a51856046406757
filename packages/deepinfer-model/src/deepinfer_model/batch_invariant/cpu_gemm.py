"""One CPU GEMM of exact products whose rows do not depend on the row count M: K in fixed blocks, a
minimum row count where torch runs several threads, and for a wide weight the NT layout with the same bits
(`_cpu_gemm`; `exact_gemm` says why exact products are the precondition)."""

from __future__ import annotations

import torch

from .fixed_bmm import _pad0

# CPU GEMMs of exact products (`_cpu_gemm`) run over K in blocks of at most GEMM_K_BLOCK columns, their
# results added in block order, and with more than one intra-op thread with at least MIN_GEMM_ROWS rows
# (zero rows appended): MKL's FP64 kernels split a longer K at points that depend on M, and its threaded
# GEMV splits one row's work. Measured on an AVX-512 host (torch 2.15): FP32-valued rows with K >= 512
# differed in their last bits between M = 1..2 and more rows, with K >= 1024 and N >= 256 between M < ~192
# and more, and with 2 threads M = 1 differed from M > 1 already at K = 129; 256-column blocks agreed for
# every M up to 700 (K up to 4096, N up to 16,160) with 1 thread, and from 3 rows on with 2 threads (the
# other host measured agreed for every M at any K). One thread keeps a decode row's GEMV.
GEMM_K_BLOCK = 256
MIN_GEMM_ROWS = 4
# Wide weights (`row_gemm`, e.g. the LM head): MKL's row-major "NN" FP64 GEMM of a few rows against a
# weight larger than the caches ran ~1.5x slower than the "NT" GEMM against the weight as stored [N, K]
# that the default mode runs (measured, 1 thread, K = 128, N = 129,280: 8 rows 39.5 vs 26.4 ms; for
# weights under ~16 MiB and from ~64 rows on NN was as fast or faster). The two layouts give the same
# bits when both run over K blocks of at most WIDE_K_BLOCK columns and NT gets a multiple of
# NT_ROW_MULTIPLE rows (zero rows appended; measured on the AVX-512 host: M = 1..300, K up to 1024, N up
# to 129,280, 1 and 2 threads; with 256-column blocks they differed from K = 200 on for narrow N, and
# NT's own GEMV for M = 1 sums in another order). So weights of at least WIDE_BYTES (FP64) keep a second
# cached copy in the stored layout (twice the memory for those weights), and NT_ROWS rows take it.
WIDE_BYTES = 16 << 20
WIDE_K_BLOCK = 128
NT_ROWS = range(4, 33)
NT_ROW_MULTIPLE = 4


def _cpu_gemm(a: torch.Tensor, b: torch.Tensor, b_nt: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b` (2-D, or 3-D as a bmm) on the CPU as GEMMs over K blocks of `GEMM_K_BLOCK` columns, summed in
    block order, of at least `MIN_GEMM_ROWS` rows where torch runs several threads: each block's sum then has
    one order for every M (see `GEMM_K_BLOCK`).

    `b_nt` (2-D only): the same weight as a contiguous [N, K] copy (a wide weight, see `WIDE_BYTES`). Then
    the blocks are `WIDE_K_BLOCK` columns, and `NT_ROWS` rows multiply `b_nt` transposed, padded to a
    multiple of `NT_ROW_MULTIPLE` rows: the same bits as `b`, faster."""
    mm = torch.mm if a.dim() == 2 else torch.bmm
    m, k = a.shape[-2], a.shape[-1]
    k_block = GEMM_K_BLOCK if b_nt is None else WIDE_K_BLOCK
    if b_nt is not None and m in NT_ROWS:
        a = _pad0(a, (-m) % NT_ROW_MULTIPLE)

        def block(lo: int, hi: int) -> torch.Tensor:
            return torch.mm(a[:, lo:hi], b_nt[:, lo:hi].t())
    else:
        a = _pad0(
            a, MIN_GEMM_ROWS - m if torch.get_num_threads() > 1 and m < MIN_GEMM_ROWS else 0, a.dim() - 2
        )

        def block(lo: int, hi: int) -> torch.Tensor:
            return mm(a[..., lo:hi], b[..., lo:hi, :])

    out = block(0, k_block)
    for k0 in range(k_block, k, k_block):
        out += block(k0, k0 + k_block)
    return out if out.shape[-2] == m else out[..., :m, :]
