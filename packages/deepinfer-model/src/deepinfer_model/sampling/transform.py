"""Logits -> the filtered distribution a token is drawn from.

Order (spec §5.2, plus min-p which the reference lacks): temperature, then top-p, then top-k, both
measured on the temperature-scaled distribution with stable tie handling (the lower token id wins),
then min-p relative to the most likely token. Every step is per row, so a row's result never
depends on the other rows of the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..runtime.device import to_device
from .params import RowParams


def filter_values(rows: list[RowParams], vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows' filter parameters as the filter reads them (host arrays): float32 temperature (1 for a
    greedy row), float32 top-p, int64 top-k (the vocabulary size when off or not below it), float32
    min-p."""
    temps = np.array([r.temperature if r.temperature > 0 else 1.0 for r in rows], np.float32)
    top_p = np.array([r.top_p for r in rows], np.float32)
    top_k = np.array([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], np.int64)
    min_p = np.array([r.min_p for r in rows], np.float32)
    return temps, top_p, top_k, min_p


def needs_sort(rows: list[RowParams], vocab: int) -> bool:
    """Whether a row filters by top-p or top-k: the filter's sort pass runs for the batch."""
    return any(r.top_p < 1.0 or 0 < r.top_k < vocab for r in rows)


def filtered_probs(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """float32 probabilities [B, V] (zeros where filtered, not renormalised) for sampled rows.

    Greedy rows (temperature 0) are returned scaled at temperature 1; the sampler takes their argmax.
    """
    device = logits.device
    vocab = logits.shape[-1]
    temps, top_p, top_k, min_p = filter_values(rows, vocab)
    # (per-row values reach the device through pinned asynchronous copies: no wait for the device here;
    # the sort and the min-p pass run only when a row asks for them)
    need_sort = needs_sort(rows, vocab)
    return filter_probs(
        logits,
        to_device(temps, device),
        to_device(top_p, device) if need_sort else None,
        to_device(top_k, device) if need_sort else None,
        to_device(min_p, device) if any(r.min_p > 0.0 for r in rows) else None,
    )


def filter_probs(
    logits: torch.Tensor,
    temps: torch.Tensor,
    top_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """`filtered_probs` on device tensors of `filter_values` (no host sync: graph-safe): `temps`,
    `top_p`, `min_p` float32 [B], `top_k` int64 [B]. `top_p` / `top_k` None skip the sort (both or
    neither), `min_p` None the min-p pass. A row whose top-p is 1 and top-k the vocabulary comes out
    of the sort pass bit for bit as it went in, and so does a row whose min-p is 0 out of the min-p
    pass (but for NaN probabilities, which it zeroes: callers zero them anyway), so a batch may run
    the passes for all rows when only some ask."""
    device = logits.device
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)

    vocab = logits.shape[-1]
    if top_p is not None:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # A token goes when the mass strictly ahead of it already exceeds p; that always keeps the top token.
        mass_ahead = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = (mass_ahead <= top_p[:, None]) | (top_p[:, None] >= 1.0)
        rank = torch.arange(vocab, device=device)
        keep_sorted &= rank[None, :] < top_k[:, None]
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros((), device=device))

    if min_p is not None:
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= threshold, probs, torch.zeros((), device=device))
    return probs
