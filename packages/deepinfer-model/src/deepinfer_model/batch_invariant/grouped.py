"""Rows sorted by group (tokens by expert, the attention's output groups) times their group's weight, each
row's result independent of the other rows, of the group sizes and of the row count (`grouped_gemm`)."""

from __future__ import annotations

import numpy as np
import torch

from . import switch
from .cpu_gemm import _cpu_gemm
from .weight_parts import GEMM_NAIVE_ELEMENTS

LOOP_ROWS = 32  # rows per non-empty group above which `grouped_gemm` takes one call per group
LOOP_GROUPS = 16  # non-empty groups up to which `grouped_gemm` takes one call per group at any row count


def grouped_gemm(
    x: torch.Tensor,
    counts: list[int],
    parts: torch.Tensor,
    loop: bool | None = None,
    fp32_valued: bool = False,
) -> torch.Tensor:
    """Rows of FP64 `x` [R, K] (on the CPU) sorted by group, `counts[e]` rows for group e, times group e's
    weight `parts[e]` ([E, K, N] from `stacked_parts`) -> FP64 [R, N], each row's result independent
    of every other row, of the group sizes and of M.

    Why it is invariant: every product is exact (as in `exact_gemm`: a row is split into hi = its FP32
    rounding and lo = the rest, at most 29 significant bits, against weights of at most 24), and MKL's
    FP64 GEMM sums exact products in the same K order for every M (over K blocks of `GEMM_K_BLOCK`, see
    `_cpu_gemm`) and every row index, in `torch.bmm` as in `torch.mm` (measured, and tested:
    `test_grouped_gemm_rows_do_not_depend_on_the_batch`). So
    all groups go into one bmm over [E', Mmax, K] (groups zero-padded to the longest; E' = the groups
    from the first to the last non-empty one, which are views of `parts`), instead of one call or one
    set of fixed row tiles per group. A row whose lo is not zero (decided from the row itself: the
    SwiGLU output of the down projection) adds the product of its lo, computed as one more row of its
    group; an FP32-valued row never sees that term (not even as +0, which would turn a -0 into +0).

    Groups of more than `LOOP_ROWS` rows on average (prefill), or at most `LOOP_GROUPS` non-empty groups
    (a shared expert, the tiny model's 8 experts), instead take one `torch.mm` per group on its
    contiguous hi rows (and one on its lo rows): the padding, scatter and gather of the single call
    cost more there than the calls (measured at decode, 8 experts, 16 rows: 80 vs 120 us for gate/up,
    140 vs 180 us for the down projection, 42 vs 129 us for a shared expert's). The same bits either
    way (`loop` forces one; tested).

    `fp32_valued`: the caller knows every row is FP32-valued (`marked_fp32_valued`): no lo terms, and
    equal groups (the attention's grouped output projection) are one bmm of the rows as they are."""
    r, k = x.shape
    n = parts.shape[2]
    if r == 0:
        return x.new_empty(0, n)
    if sum(counts) != r or len(counts) != parts.shape[0]:
        raise ValueError(f"grouped_gemm: counts {counts} do not describe {r} rows of {parts.shape[0]} groups")
    x = x.contiguous()
    if fp32_valued and not loop and len(set(counts)) == 1 and k * n * counts[0] >= GEMM_NAIVE_ELEMENTS:
        return _cpu_gemm(x.view(len(counts), counts[0], k), parts).reshape(r, n)
    # FP32-valued rows (known, or found here) have no lo part
    hi, lo = (x, None) if fp32_valued else (x.float().double(), None)
    if not fp32_valued:
        lo = x - hi
    used_groups = sum(1 for c in counts if c)
    if switch._SYNC_FREE or (
        loop if loop is not None else used_groups <= LOOP_GROUPS or r > LOOP_ROWS * used_groups
    ):
        return _grouped_loop(hi, lo, counts, parts)
    if lo is None:
        wide = torch.zeros(0, dtype=torch.long)
    else:
        wide = torch.nonzero(lo.ne(0).any(dim=1)).flatten()  # rows with more bits (NaN rows too: lo is NaN)
    # the rows' slots in the padded [E', Mmax] layout, on the host (the counts are host values)
    cnt = np.asarray(counts, dtype=np.int64)
    group = np.repeat(np.arange(len(cnt)), cnt)
    total = cnt.copy()
    if len(wide):  # each wide row's lo goes in its group after the group's rows, in row order
        wg = group[wide.numpy()]
        n_wide = np.bincount(wg, minlength=len(cnt))
        lo_slot = cnt[wg] + np.arange(len(wg)) - (np.cumsum(n_wide) - n_wide)[wg]
        total += n_wide
    used = np.flatnonzero(cnt)
    first, last = int(used[0]), int(used[-1]) + 1
    mmax = int(total.max())
    if k * n * mmax < GEMM_NAIVE_ELEMENTS:
        raise ValueError(
            f"grouped_gemm: K * N = {k * n} is below GEMM_NAIVE_ELEMENTS = {GEMM_NAIVE_ELEMENTS}"
        )
    w = parts[first:last]  # a view: the groups in range, empty ones included (their rows are zeros)
    if not len(wide) and bool((cnt[first:last] == mmax).all()):  # every group full: no padding needed
        return _cpu_gemm(hi.view(last - first, mmax, k), w).reshape(r, n)
    dest = torch.from_numpy((group - first) * mmax + np.arange(r) - (np.cumsum(cnt) - cnt)[group])
    a = x.new_zeros((last - first) * mmax, k)
    a[dest] = hi
    if len(wide):
        lo_dest = torch.from_numpy((wg - first) * mmax + lo_slot)
        a[lo_dest] = lo[wide]
    prod = _cpu_gemm(a.view(last - first, mmax, k), w).reshape(-1, n)
    out = prod[dest]
    if len(wide):
        out[wide] = out[wide] + prod[lo_dest]
    return out


def _grouped_loop(
    hi: torch.Tensor, lo: torch.Tensor | None, counts: list[int], parts: torch.Tensor
) -> torch.Tensor:
    """`grouped_gemm` as one mm per non-empty group of its hi rows against `parts[e]` and, where some row
    has a lo part (None: no row has), one more per group of its lo rows; a row adds its lo product only
    if its own lo is not zero. Separate calls give each row the bits of one call of [hi; lo] rows (a
    row's exact-product GEMM result does not depend on M or on its index, see `exact_gemm`), without
    copying them into one operand."""

    def products(rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], parts.shape[2])
        start = 0
        for e, c in enumerate(counts):
            if c:
                out[start : start + c] = _cpu_gemm(rows[start : start + c], parts[e])
                start += c
        return out

    out = products(hi)
    if lo is None:
        return out
    has_lo = lo.ne(0).any(dim=1, keepdim=True)  # (NaN rows too: lo is NaN)
    if switch._SYNC_FREE:  # (see `sync_free`: the same bits as either branch below, per row)
        return torch.where(has_lo, out + products(lo), out)
    if not bool(has_lo.any()):
        return out
    if bool(has_lo.all()):  # (the SwiGLU output: every row has more than 24 significant bits)
        return out + products(lo)
    return torch.where(has_lo, out + products(lo), out)
