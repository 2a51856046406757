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


def filtered_probs(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """float32 probabilities [B, V] (zeros where filtered, not renormalised) for sampled rows.

    Greedy rows (temperature 0) are returned scaled at temperature 1; the sampler takes their argmax.
    """
    device = logits.device
    # (per-row values reach the device through pinned asynchronous copies: no wait for the device here)
    temps = to_device(
        np.array([r.temperature if r.temperature > 0 else 1.0 for r in rows], np.float32), device
    )
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)

    vocab = logits.shape[-1]
    need_sort = [r.top_p < 1.0 or 0 < r.top_k < vocab for r in rows]
    if any(need_sort):
        top_p = to_device(np.array([r.top_p for r in rows], np.float32), device)
        top_k = to_device(
            np.array([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], np.int64), device
        )
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # A token goes when the mass strictly ahead of it already exceeds p; that always keeps the top token.
        mass_ahead = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = (mass_ahead <= top_p[:, None]) | (top_p[:, None] >= 1.0)
        rank = torch.arange(vocab, device=device)
        keep_sorted &= rank[None, :] < top_k[:, None]
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros((), device=device))

    if any(r.min_p > 0.0 for r in rows):
        min_p = to_device(np.array([r.min_p for r in rows], np.float32), device)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= threshold, probs, torch.zeros((), device=device))
    return probs
