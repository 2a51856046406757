"""The vision tower: encoder then aligner, from one image's patches to its language-model embeddings.

The math dtype defaults to the weights' device (`encoder.default_dtype`: BF16 on CUDA, FP32 on the CPU) and
the attention to "auto" (fused on CUDA, the einsum reference elsewhere); see `encoder.py`. The weights are
cast once per math dtype and kept (a checkpoint loads them as FP32, so the BF16 copy of the V4.1-Flash
encoder and aligner adds about 1 GB on the GPU). The embeddings leave in the math dtype; the language
model's embedding path (`embed.image_input_embeddings`) rounds them to its activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .aligner import align, pixel_unshuffle
from .config import VisionConfig
from .encoder import check_math_dtype, default_dtype, encode_image, residual_dtype
from .weights import VisionWeights


@dataclass
class VisionTower:
    config: VisionConfig
    weights: VisionWeights
    _cast: dict[torch.dtype, VisionWeights] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def device(self) -> torch.device:
        return self.weights.patch_embed.device

    @property
    def default_dtype(self) -> torch.dtype:
        """The math dtype `embed_image` uses when given none: BF16 on CUDA, FP32 elsewhere."""
        return default_dtype(self.device)

    def weights_for(self, dtype: torch.dtype) -> VisionWeights:
        """The weights cast for math in `dtype` (made on first use, then kept)."""
        w = self._cast.get(dtype)
        if w is None:
            check_math_dtype(dtype)
            w = self._cast[dtype] = self.weights.cast(dtype, residual_dtype(dtype))
        return w

    def embed_image(
        self,
        patches: torch.Tensor,
        patch_rows: int,
        patch_cols: int,
        dtype: torch.dtype | None = None,
        attention: str = "auto",
    ) -> torch.Tensor:
        """Embeddings [(patch_rows/r) * (patch_cols/r), d] in `dtype` of one image, merged cells in row-major
        order. `dtype` None: `default_dtype`; `attention`: "auto", "fused" or "reference" (`encoder.py`)."""
        dt = self.default_dtype if dtype is None else dtype
        w = self.weights_for(dt)
        features = encode_image(patches, patch_rows, patch_cols, w, self.config, dt, attention)
        merged = pixel_unshuffle(features.to(dt), patch_rows, patch_cols, self.config.downsample_ratio)
        return align(merged, w)
