"""Which (row tile, key tile) pairs of a `sink_attention` call some row sees (`AttentionPlan`): built once
per step and key set from the visibility mask, so every layer computes only the seen tiles."""

from __future__ import annotations

import copy

import numpy as np
import torch

from .fixed_bmm import TILE_ROWS, _products, bmm
from .key_layout import KEY_TILE

DENSE_FRACTION = 0.5  # attention plans seeing more of their tiles than this take the dense layout


def _seen_from_queries(q_seen: np.ndarray, heads: int, row_tiles: int) -> np.ndarray:
    """q_seen bool [B, M, T] (query m sees some column of key tile t) -> bool [B, Rt, T]: whether any row
    of score row tile r (rows m * heads + h, in tiles of `TILE_ROWS`; padding rows see nothing) does."""
    bsz, m, t = q_seen.shape
    rows = np.arange(row_tiles * TILE_ROWS) // heads
    seen = q_seen[:, np.minimum(rows, m - 1), :] & (rows < m)[None, :, None]
    return seen.reshape(bsz, row_tiles, TILE_ROWS, t).any(axis=2)


class AttentionPlan:
    """Which (row tile, key tile) pairs of a `sink_attention` call some row sees, as index tensors: a
    function of the visibility mask and the head count only, so the paged runtime builds it once per step
    and key set and every layer reuses it (`plan_attention`)."""

    def __init__(self, visible: torch.Tensor, heads: int):
        bsz, m, s = visible.shape
        if s % KEY_TILE:
            raise ValueError(f"keys.shape[1] = {s} must be a multiple of KEY_TILE = {KEY_TILE}")
        n_tiles = s // KEY_TILE
        dev = visible.device
        rt = -(-(m * heads) // TILE_ROWS)
        vis_t = visible.view(bsz, m, n_tiles, KEY_TILE)
        # which tiles each query sees: one small [B, M, T] read to the host (no sync cost on the CPU)
        seen = _seen_from_queries(vis_t.any(dim=-1).cpu().numpy(), heads, rt)  # [B, Rt, T]
        bi, ri, ti = np.nonzero(seen)  # seen tiles in (sequence, row tile, key tile) order
        n_sel = len(bi)
        self.shape = (bsz, m, heads, n_tiles, rt)
        self.seen = seen
        # most tiles seen (short contexts, compressed entries every query sees): the dense layout with
        # only the products skipped costs less than gathering the seen tiles (measured on the tiny model)
        self.dense = n_sel > DENSE_FRACTION * seen.size
        self.visible = visible
        if self.dense:
            return
        br = bi * rt + ri  # flat row tile of each seen tile
        # order [B*Rt, K]: slot k of a row tile holds the index of its k-th seen tile (key tile order),
        # or N where it has fewer (the pad entry appended to each per-tile result)
        first = np.searchsorted(br, np.arange(bsz * rt))
        count = np.bincount(br, minlength=bsz * rt)
        k_max = max(int(count.max()) if n_sel else 0, 1)
        slot = np.arange(k_max)[None, :]
        order = np.where(slot < count[:, None], first[:, None] + slot, n_sel)
        # each seen tile's mask: tile row j of row tile r is query (r * 8 + j) // heads (padding rows
        # see nothing)
        rows = np.arange(rt * TILE_ROWS) // heads
        qrow = np.minimum(rows, m - 1).reshape(rt, TILE_ROWS)
        real = (rows < m).reshape(rt, TILE_ROWS)
        idx = [torch.from_numpy(x).to(dev) for x in (bi[:, None], qrow[ri], ti[:, None])]
        self._tile_index = (*idx, torch.from_numpy(real[ri]).to(dev)[:, :, None])
        self.hidden = self._hidden(vis_t)
        self.n_sel, self.k_max = n_sel, k_max
        self.row_tile = torch.from_numpy(br).to(dev)
        self.key_tile = torch.from_numpy(bi * n_tiles + ti).to(dev)
        self.order = torch.from_numpy(order).to(dev)
        self.heads = torch.from_numpy(np.arange(rt * TILE_ROWS) % heads).to(dev)
        self.real = torch.from_numpy(real.reshape(-1)).to(dev)
        # on the CPU with many row tiles per key tile (prefill): one call per key tile, the key tile
        # broadcast (a gathered copy per row tile would cost more than the products); few (decode), and
        # off the CPU (`tile_bmm` gathers in one call): one gathered call
        kflat = bi * n_tiles + ti
        self.by_key: list[tuple[int, torch.Tensor]] | None = None
        if dev.type == "cpu" and n_sel >= 4 * len(np.unique(kflat)):
            srt = np.argsort(kflat, kind="stable")
            cuts = np.flatnonzero(np.diff(kflat[srt])) + 1
            self.by_key = [(int(kflat[g[0]]), torch.from_numpy(g).to(dev)) for g in np.split(srt, cuts)]

    def _hidden(self, vis_t: torch.Tensor) -> torch.Tensor:
        b, q, t, real = self._tile_index
        return ~(vis_t[b, q, t] & real)

    def for_visible(self, visible: torch.Tensor) -> AttentionPlan:
        """This plan (built for a superset of `visible`, e.g. every entry a query may select) for the exact
        mask `visible` [B, M, S]: the same tiles are computed, the ones no row of the exact mask sees give
        exact +0 partials (see `sink_attention`), so the bits are those of a plan of `visible` itself.
        Device ops only: `visible` (a top-k selection, on the GPU) is never read to the host."""
        if visible.shape != self.visible.shape:
            raise ValueError(
                f"for_visible: mask {tuple(visible.shape)} for a plan of {tuple(self.visible.shape)}"
            )
        plan = copy.copy(self)
        plan.visible = visible
        if not self.dense:
            plan.hidden = self._hidden(visible.view(*visible.shape[:2], -1, KEY_TILE))
        return plan


def _plan_products(plan: AttentionPlan, a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a[ia[j]] @ b[plan.key_tile[j]] for every seen tile j (see `_products`; on the CPU with many row
    tiles per key tile one call per key tile, the key tile broadcast)."""
    if plan.by_key is None:
        return _products(a, b, ia, plan.key_tile)
    out = a.new_empty(plan.n_sel, a.shape[1], b.shape[2])
    for kt, idx in plan.by_key:
        out[idx] = bmm(a[ia[idx]], b[kt].expand(len(idx), -1, -1))
    return out


def plan_attention(visible: torch.Tensor, heads: int) -> AttentionPlan:
    """The `AttentionPlan` of visible [B, M, S] for `heads` query heads."""
    return AttentionPlan(visible, heads)
