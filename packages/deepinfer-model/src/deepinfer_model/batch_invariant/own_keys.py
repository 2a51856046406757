"""Each query's own keys in `sink_attention` (a sparse layer's top-k selected compressed entries, after the
shared tiles): their scores, their share of the row max, and their P.V partials, added after the shared
tiles' one own tile at a time."""

from __future__ import annotations

import torch

from .fixed_bmm import bmm
from .key_layout import KEY_TILE


def _own_scores(q: torch.Tensor, own: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """Scaled scores of every query [B, M, nh, D] against its own keys (own = (keys [B, M, Ko, D], visible
    bool [B, M, Ko])): FP64 [B, M, nh, Ko], -inf where not visible. One [nh, D] x [D, Ko] product per query
    (`bmm`: its bits do not depend on how many queries share the call), the same in every path."""
    keys, vis = own
    b, m, nh, d = q.shape
    ko = keys.shape[2]
    kt = keys.double().reshape(b * m, ko, d).transpose(1, 2).contiguous()  # [B*M, D, Ko]
    sc = bmm(q.double().reshape(b * m, nh, d).contiguous(), kt).view(b, m, nh, ko) * scale
    return sc.masked_fill_(~vis[:, :, None, :], float("-inf"))


def _own_partials(scores: torch.Tensor, mx: torch.Tensor, own: tuple[torch.Tensor, torch.Tensor]):
    """Unnormalised P.[K | 1] of every query's own keys, per own tile: exp(scores - mx) (mx [B, M, nh], each
    row's max over all its keys and the sink; the exp on whole tiles, see `_whole_exp`) times the tile's
    [K | 1], one [nh, tile] x [tile, D + 1] product per (query, own tile) -> FP64 [B, M, To, nh, D + 1]."""
    keys, vis = own
    b, m, nh, ko = scores.shape
    d = keys.shape[-1]
    tile = min(KEY_TILE, ko)
    to = ko // tile
    e = _whole_exp((scores - mx[..., None]).nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0))
    e = e.mul_(vis[:, :, None, :].double())  # (masked entries: exp(0) * 0, see `_masked_exp`)
    pt = e.view(b * m, nh, to, tile).transpose(1, 2).contiguous().view(-1, nh, tile)
    vals = torch.cat((keys.double(), keys.new_ones((b, m, ko, 1), dtype=torch.float64)), dim=-1)
    return bmm(pt, vals.view(-1, tile, d + 1)).view(b, m, to, nh, d + 1)


def _whole_exp(x: torch.Tensor) -> torch.Tensor:
    """exp of a contiguous tensor computed as a flat vector whose length is a multiple of `KEY_TILE`
    (zero-padded when it is not): every element takes the vector exp, never a scalar tail."""
    n = x.numel()
    if n % KEY_TILE == 0:
        return torch.exp(x)
    flat = x.new_zeros(n + (-n) % KEY_TILE)
    flat[:n] = x.reshape(-1)
    return torch.exp(flat)[:n].view(x.shape)


def _with_own(acc: torch.Tensor, part: torch.Tensor | None) -> torch.Tensor:
    """acc [B, M, nh, D + 1] (a row's shared-tile partials summed in tile order) plus its own tiles'
    partials `part` [B, M, To, nh, D + 1] added after them, one tile at a time in own tile order."""
    if part is not None:
        for t in range(part.shape[2]):
            acc = acc + part[:, :, t]
    return acc


def _own_max(mx: torch.Tensor, own_scores: torch.Tensor | None) -> torch.Tensor:
    """mx [B, M, nh] (max over the shared keys and the sink) with the own keys' max included."""
    return mx if own_scores is None else torch.maximum(mx, own_scores.amax(dim=-1))
