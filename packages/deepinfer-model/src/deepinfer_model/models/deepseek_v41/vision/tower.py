"""The vision tower: encoder then aligner, from one image's patches to its language-model embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aligner import align, pixel_unshuffle
from .config import VisionConfig
from .encoder import encode_image
from .weights import VisionWeights


@dataclass
class VisionTower:
    config: VisionConfig
    weights: VisionWeights

    def embed_image(
        self, patches: torch.Tensor, patch_rows: int, patch_cols: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Embeddings [(patch_rows/r) * (patch_cols/r), d] of one image, merged cells in row-major order."""
        features = encode_image(patches, patch_rows, patch_cols, self.weights, self.config, dtype)
        merged = pixel_unshuffle(features, patch_rows, patch_cols, self.config.downsample_ratio)
        return align(merged, self.weights)
