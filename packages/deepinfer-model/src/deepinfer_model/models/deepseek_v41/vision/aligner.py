"""The aligner: an r x r pixel-unshuffle of the encoder's patch grid, then Linear -> GELU -> Linear.

Merged cell `(i, j)` concatenates the features of patches `(r*i + a, r*j + b)` for `a`, then `b`, in
row-major order (`a` outer), giving `r*r*W` values; the MLP maps them to the language model's width.
GELU is the exact (erf) form.
"""

from __future__ import annotations

import torch

from .weights import VisionWeights


def pixel_unshuffle(features: torch.Tensor, rows: int, cols: int, r: int) -> torch.Tensor:
    """[rows*cols, W] patch features (row-major) -> [(rows/r)*(cols/r), r*r*W] merged cells (row-major)."""
    if rows % r or cols % r:
        raise ValueError(
            f"the patch grid {rows}x{cols} must be a multiple of the merge size {r} on each side"
        )
    W = features.shape[-1]
    grid = features.reshape(rows // r, r, cols // r, r, W)  # [i, a, j, b, W]
    return grid.permute(0, 2, 1, 3, 4).reshape((rows // r) * (cols // r), r * r * W)


def align(merged: torch.Tensor, weights: VisionWeights) -> torch.Tensor:
    """Language-model embeddings [cells, d] of merged cells [cells, r*r*W] (math in `merged`'s dtype)."""
    dt = merged.dtype
    h = merged @ weights.fc1.to(dt).T + weights.fc1_bias.to(dt)
    h = torch.nn.functional.gelu(h)
    return h @ weights.fc2.to(dt).T + weights.fc2_bias.to(dt)
