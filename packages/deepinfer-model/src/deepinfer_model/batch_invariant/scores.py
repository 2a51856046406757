"""Attention scores q . k whose every dot product has one fixed shape: the tiled GEMMs (`tiled_scores`)
and, for FP32-valued operands on the CPU, one keys-as-rows GEMM with the same bits (`row_scores`)."""

from __future__ import annotations

import numpy as np
import torch

from .fixed_bmm import TILE_ROWS, _products
from .fp32_values import _fp32_valued, marked_fp32_valued
from .key_layout import KEY_TILE
from .tile_products import _row_tiles, _tile_products

SCORE_COLS = 4  # `row_scores`: query rows (GEMM columns) padded to a multiple of this (odd counts differ)


def exact_scores_apply(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `row_scores` may replace `tiled_scores` for q . keys: on the CPU, FP64, `keys` marked
    FP32-valued and every value of `q` (small: checked here) FP32-valued."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float64
        and keys.dtype == torch.float64
        and marked_fp32_valued(keys)
        and (marked_fp32_valued(q) or _fp32_valued(q))
    )


def row_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`tiled_scores(q, keys)` bit for bit, for FP32-valued q [B, R, D] and keys [B, S, D] on the CPU
    (`exact_scores_apply`), as one NN bmm keys [S, D] @ q^T [D, R] per sequence: no padded row tiles, no
    transposed key copy.

    Why it is the same: a product of two FP32 values (24 significant bits each) is exact in FP64, and MKL's
    FP64 GEMM sums exact products over K in one order whatever M and N are when both operands are
    contiguous row-major (measured: [8, D] x [D, 32] tiles, [R, D] x [D, S] and [S, D] x [D, R] agree
    bitwise for every even R = 2..64 and up to 1000, S = 32..1024, D = 64..576, 1 and 2 threads; an odd R,
    a scalar column tail, and transposed operand layouts do not), so a (row, key) score is the same
    function of the two vectors in either shape (tested: `test_row_scores_equal_the_tiled_scores`).
    q's rows are therefore zero-padded to a multiple of `SCORE_COLS` columns."""
    if keys.shape[1] % KEY_TILE:
        raise ValueError(f"keys.shape[1] = {keys.shape[1]} must be a multiple of KEY_TILE = {KEY_TILE}")
    b, r, d = q.shape
    pad = (-r) % SCORE_COLS
    q_t = q.new_zeros(b, d, r + pad)
    q_t[:, :, :r] = q.transpose(1, 2)
    out = torch.bmm(keys.contiguous(), q_t)  # [B, S, R + pad]
    return (out if not pad else out[:, :, :r]).transpose(1, 2)


def tiled_scores(
    q: torch.Tensor, keys: torch.Tensor, seen: np.ndarray | None = None, gather: bool = False
) -> torch.Tensor:
    """q [B, R, D] . keys [B, S, D] -> FP64 [B, R, S] (S a multiple of `KEY_TILE`), every dot product in a
    fixed-shape [TILE_ROWS, D] x [D, KEY_TILE] GEMM with fixed operand layouts (contiguous row tile,
    contiguous transposed key tile): a (row, key) score depends on nothing else. `seen` (see
    `_tile_products`): only the tiles where it holds are computed, the others are 0 (to be masked)."""
    bsz, r, d = q.shape
    s = keys.shape[1]
    if s % KEY_TILE:
        raise ValueError(f"keys.shape[1] = {s} must be a multiple of KEY_TILE = {KEY_TILE}")
    n_tiles = s // KEY_TILE
    qt = _row_tiles(q.double()).contiguous()[:, :, None]  # [B, Rt, 1, 8, D]
    kt = keys.double().view(bsz, n_tiles, KEY_TILE, d).transpose(-1, -2).contiguous()  # [B, St, D, KT]
    if seen is not None or not gather:  # (`gather=False`: the per-tile loop, a reference for tests)
        out = _tile_products(qt, kt, seen)  # [B, Rt, St, 8, KT]
    else:  # every tile: one gathered product list (one bmm call on the CPU instead of one per tile)
        rt = qt.shape[1]
        bi, ri, ti = (x.reshape(-1) for x in np.indices((bsz, rt, n_tiles)))
        ia = torch.from_numpy(bi * rt + ri).to(q.device)
        ib = torch.from_numpy(bi * n_tiles + ti).to(q.device)
        prods = _products(qt.reshape(bsz * rt, TILE_ROWS, d), kt.reshape(bsz * n_tiles, d, KEY_TILE), ia, ib)
        out = prods.view(bsz, rt, n_tiles, TILE_ROWS, KEY_TILE)
    return out.permute(0, 1, 3, 2, 4).reshape(bsz, -1, s)[:, :r]
