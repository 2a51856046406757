"""Engram n-gram hashing (spec v41-model §5.2, §5.3): per token, one table row per (n-gram size, head).

Every (layer, n-gram size n = 2..N, head) owns a sub-table of prime size; the primes are consecutive
distinct primes >= `engram_vocab_size`, handed out in (layer, n, head) order. A token's n-gram of
compressed ids `tok_0` (itself), `tok_1` (previous), ... is hashed with odd per-layer multipliers drawn
from NumPy's PCG64 seeded by `10007 * layer_id`, xor-folded, and reduced modulo each sub-table size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import EngramConfig

_SEED_STRIDE = 10007


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


@dataclass(frozen=True)
class EngramLayout:
    """`primes[layer_pos][n-2][head]`; `offsets[layer_pos]` [(N-1)*n_heads] row offsets into that layer's table."""

    layer_ids: tuple[int, ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[torch.Tensor, ...]

    @classmethod
    def from_config(cls, cfg: EngramConfig) -> EngramLayout:
        used: set[int] = set()
        primes = []
        for _layer in cfg.layer_ids:
            per_layer = []
            for _n in range(2, cfg.max_ngram_size + 1):
                start, heads = cfg.vocab_size - 1, []
                for _head in range(cfg.n_heads):
                    p = start + 1
                    while p in used or not _is_prime(p):
                        p += 1
                    used.add(p)
                    heads.append(p)
                    start = p
                per_layer.append(tuple(heads))
            primes.append(tuple(per_layer))
        offsets = []
        for per_layer in primes:
            sizes = torch.tensor([p for heads in per_layer for p in heads], dtype=torch.long)
            offsets.append(torch.cumsum(sizes, 0) - sizes)
        return cls(tuple(cfg.layer_ids), tuple(primes), tuple(offsets))

    def table_rows(self, layer_id: int) -> int:
        """Rows of layer `layer_id`'s table (sum of its prime sizes)."""
        per_layer = self.primes[self.layer_ids.index(layer_id)]
        return sum(p for heads in per_layer for p in heads)


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """Odd int64 multipliers [N] of one Engram layer: `2a + 1`, `a` from PCG64(seed = 10007 * layer_id)."""
    bound = max(1, (2**63 - 1) // compressed_vocab_size // 2)
    rng = np.random.default_rng(_SEED_STRIDE * layer_id)
    a = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return torch.from_numpy(2 * a + 1)


def ngram_context(compressed: torch.Tensor, max_ngram_size: int, pad_id: int) -> torch.Tensor:
    """[T, N]: entry k = compressed id of the token k positions back in the sequence (k = 0: itself).

    Positions before the sequence start give `pad_id`; from the first image sentinel (-1) met going
    back, that entry and all older ones are `pad_id`.
    """
    t = compressed.shape[0]
    ctx = torch.full((t, max_ngram_size), pad_id, dtype=torch.long, device=compressed.device)
    for k in range(max_ngram_size):
        if k < t:
            ctx[k:, k] = compressed[: t - k]
    hit_image = torch.cumsum((ctx < 0).long(), dim=1) > 0
    return ctx.masked_fill(hit_image, pad_id)


def engram_hash(
    compressed: torch.Tensor, layout: EngramLayout, layer_id: int, multipliers: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """Table row ids [T, (N-1)*n_heads] (order n-major, head-minor) of one layer; image tokens get -1."""
    pos = layout.layer_ids.index(layer_id)
    per_layer = layout.primes[pos]
    n_max = len(per_layer) + 1
    ctx = ngram_context(compressed, n_max, pad_id)
    prods = ctx * multipliers[None, :]  # tok < Vc keeps every product below 2^63
    cols, h = [], prods[:, 0]
    for i in range(1, n_max):
        h = torch.bitwise_xor(h, prods[:, i])
        for p in per_layer[i - 1]:
            cols.append(torch.remainder(h, p))
    idx = torch.stack(cols, dim=1) + layout.offsets[pos][None, :]
    return idx.masked_fill((compressed < 0)[:, None], -1)
