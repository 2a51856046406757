"""`x @ w_t` with each row's result independent of the batch: on the CPU (FP64) exact-product GEMMs chosen
per row from the row itself (`row_gemm`, `exact_gemm`), elsewhere the device backend's row op
(`device_rows`); `matmul` picks the path."""

from __future__ import annotations

import torch

from . import switch
from .cpu_gemm import _cpu_gemm
from .fixed_bmm import _device_ops, tiled_matmul
from .fp32_values import marked_fp32_valued
from .switch import enabled
from .weight_parts import _row_major


def exact_gemm(a: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """`a @ sum(parts)` on the CPU (2-D, or 3-D as a bmm) for FP64 `a` and FP64 `parts` of at most 24
    significant bits each (contiguous, last dim a multiple of `COL_PAD`), with every product exact.

    Why: MKL's FP64 kernels sum over K in the same order for every M (measured: operands whose products are
    exact gave bitwise equal rows for M = 1..2048 at any row offset, K up to 7168, 1 and 2 threads, on one
    host; on an AVX-512 host only over K blocks of at most `GEMM_K_BLOCK` columns and, with several threads,
    from `MIN_GEMM_ROWS` rows on, which `_cpu_gemm` therefore runs), but rows in full register blocks and the
    other rows (the GEMV of M = 1, a tail of M mod 4 rows) differ in fused vs separate multiply-add: with
    inexact products a row's bits then depend on M and on its index. A product of a 24-bit and a 29-bit
    significand fits FP64's 53 bits, so `a` is split into hi = `a` rounded to FP32 and lo = a - hi (exact, at
    most 29 significant bits; `a` within FP32's normal range). The result is the sum over parts of hi @ part,
    then of lo @ part for the rows whose lo is not zero (decided per row from the row itself, so a row of FP32
    values never sees those terms, not even as a +0 that would turn a -0 into +0). Activations are
    FP32/BF16-valued at most GEMM inputs: one GEMM per weight part there."""
    a = a.contiguous()
    hi = a.float().double()
    lo = a - hi
    out = _cpu_gemm(hi, parts[0])
    for p in parts[1:]:
        out = out + _cpu_gemm(hi, p)
    if switch._SYNC_FREE or bool(lo.any()):  # (one cheap test first: most GEMM inputs are FP32/BF16 values)
        has_lo = lo.ne(0).any(dim=-1, keepdim=True)
        low = _cpu_gemm(lo, parts[0])
        for p in parts[1:]:
            low = low + _cpu_gemm(lo, p)
        out = torch.where(has_lo, out + low, out)
    return out


def row_gemm(x: torch.Tensor, w_t: torch.Tensor, fp32_valued: bool = False) -> torch.Tensor:
    """`x @ w_t` (`w_t` widened to FP64) for 2-D FP64 `x` [M, K] on the CPU, each row's result independent
    of M and of the other rows. Chosen per row from the row itself (so a row takes the same path in
    every batch): a row of FP32 values goes through one GEMM with the weight as a row-major [K, N]
    operand (MKL's "NN" kernel, which keeps its K order for every M, and with FP32-valued weights every
    product exact, see `exact_gemm`; zero columns up to a multiple of `COL_PAD`: an odd N, a scalar
    column tail, changed row bits too); a row with more bits (e.g. the SwiGLU output) goes through the
    fixed 8-row tiles of `tiled_matmul`, cheaper than `exact_gemm`'s second GEMM for it. Weights that
    are not FP32-valued take `exact_gemm` (split in parts) for every row. A wide weight (the LM head)
    gives 4..32 FP32-valued rows to the faster NT GEMM, with the same bits (see `WIDE_BYTES`)."""
    m, n = x.shape[0], w_t.shape[1]
    if m == 0:
        return x.new_empty(0, n)
    parts, nt = _row_major(w_t)
    x = x.contiguous()
    if len(parts) > 1:
        out = exact_gemm(x, parts)
        return out if out.shape[1] == n else out[:, :n]
    if fp32_valued:  # the caller knows every row is FP32-valued (`marked_fp32_valued`): no test
        out = _cpu_gemm(x, parts[0], nt)
        return out if out.shape[1] == n else out[:, :n]
    fp32 = x.float().double()
    if switch._SYNC_FREE:  # both paths for every row, each row takes its own (see `sync_free`)
        wide = x.ne(fp32).any(dim=-1, keepdim=True)
        return torch.where(wide, tiled_matmul(x, parts[0]), _cpu_gemm(x, parts[0], nt))[:, :n]
    if torch.equal(x, fp32):  # every row FP32-valued (the common case: one test, one host read)
        out = _cpu_gemm(x, parts[0], nt)
        return out if out.shape[1] == n else out[:, :n]
    wide = x.ne(fp32).any(dim=-1)  # rows with more than FP32's 24 significant bits (NaN rows too)
    if bool(wide.all()):
        return tiled_matmul(x, parts[0])[:, :n]
    out = x.new_empty(m, n)
    short = ~wide
    out[short] = _cpu_gemm(x[short], parts[0], nt)[:, :n]
    out[wide] = tiled_matmul(x[wide], parts[0])[:, :n]
    return out


def matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`x @ w_t` over the last dim of `x` (any leading dims); row-invariant when the mode is on."""
    if not enabled():
        return x @ w_t
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.device.type == "cpu" and flat.dtype == torch.float64 and w_t.dtype == torch.float64:
        out = row_gemm(flat, w_t, marked_fp32_valued(x))
    elif flat.device.type == "cpu":
        out = tiled_matmul(flat, w_t)
    else:
        out = device_rows(flat, w_t.t())
    return out.reshape(*lead, w_t.shape[1])


def device_rows(x: torch.Tensor, weight: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    """The mode's `x @ weight.T` off the CPU for 2-D `x` (FP64 or FP32) and a weight [N, K] as stored: the
    `rows_matmul` op of the device's backend (the reference: `tiled_matmul` against the weight widened to
    `x.dtype`; NVIDIA: a Triton kernel that costs one row of work per row, no padded tiles), its output
    rounded to `round_to` (FP32 / BF16 / FP16, or None) in x.dtype."""
    return _device_ops().rows_matmul(x, weight, round_to)
