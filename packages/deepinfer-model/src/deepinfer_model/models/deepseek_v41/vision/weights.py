"""Typed vision-tower weights (encoder blocks and aligner) from checkpoint names (see `layout.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import VisionConfig


@dataclass
class VisionBlockWeights:
    norm1: torch.Tensor  # [W]
    qkv: torch.Tensor  # [3W, W]
    qkv_bias: torch.Tensor  # [3W]
    proj: torch.Tensor  # [W, W]
    norm2: torch.Tensor  # [W]
    w13: torch.Tensor  # [2I, W] gate rows then up rows
    w2: torch.Tensor  # [W, I]

    def cast(self, dtype: torch.dtype, norm_dtype: torch.dtype) -> VisionBlockWeights:
        """Matrices and biases in `dtype`, the RMSNorm weights in `norm_dtype` (no copy of a tensor already so)."""
        return VisionBlockWeights(
            norm1=self.norm1.to(norm_dtype),
            qkv=self.qkv.to(dtype),
            qkv_bias=self.qkv_bias.to(dtype),
            proj=self.proj.to(dtype),
            norm2=self.norm2.to(norm_dtype),
            w13=self.w13.to(dtype),
            w2=self.w2.to(dtype),
        )


@dataclass
class VisionWeights:
    patch_embed: torch.Tensor  # [W, C*p*p]
    patch_bias: torch.Tensor  # [W]
    blocks: list[VisionBlockWeights]
    norm: torch.Tensor  # [W]
    fc1: torch.Tensor  # [d, r*r*W]
    fc1_bias: torch.Tensor
    fc2: torch.Tensor  # [d, d]
    fc2_bias: torch.Tensor

    def cast(self, dtype: torch.dtype, norm_dtype: torch.dtype) -> VisionWeights:
        """These weights with matrices and biases in `dtype` and the RMSNorm weights in `norm_dtype`; `self`
        when they already are. A cast copies every tensor not yet in its dtype, so callers that run many images
        keep the result (`VisionTower` does, per dtype) rather than cast on every call."""
        if self._dtypes_are(dtype, norm_dtype):
            return self
        return VisionWeights(
            patch_embed=self.patch_embed.to(dtype),
            patch_bias=self.patch_bias.to(dtype),
            blocks=[b.cast(dtype, norm_dtype) for b in self.blocks],
            norm=self.norm.to(norm_dtype),
            fc1=self.fc1.to(dtype),
            fc1_bias=self.fc1_bias.to(dtype),
            fc2=self.fc2.to(dtype),
            fc2_bias=self.fc2_bias.to(dtype),
        )

    def _dtypes_are(self, dtype: torch.dtype, norm_dtype: torch.dtype) -> bool:
        mats = [self.patch_embed, self.patch_bias, self.fc1, self.fc1_bias, self.fc2, self.fc2_bias]
        norms = [self.norm]
        for b in self.blocks:
            mats += [b.qkv, b.qkv_bias, b.proj, b.w13, b.w2]
            norms += [b.norm1, b.norm2]
        return all(t.dtype == dtype for t in mats) and all(t.dtype == norm_dtype for t in norms)

    @classmethod
    def from_tensors(cls, vcfg: VisionConfig, get: Callable[[str], torch.Tensor]) -> VisionWeights:
        blocks = []
        for i in range(vcfg.num_hidden_layers):
            p = f"vision.blocks.{i}."
            blocks.append(
                VisionBlockWeights(
                    norm1=get(p + "norm1.weight"),
                    qkv=get(p + "attn.qkv.weight"),
                    qkv_bias=get(p + "attn.qkv.bias"),
                    proj=get(p + "attn.proj.weight"),
                    norm2=get(p + "norm2.weight"),
                    w13=get(p + "mlp.w13.weight"),
                    w2=get(p + "mlp.w2.weight"),
                )
            )
        return cls(
            patch_embed=get("vision.patch_embed.weight"),
            patch_bias=get("vision.patch_embed.bias"),
            blocks=blocks,
            norm=get("vision.norm.weight"),
            fc1=get("aligner.fc1.weight"),
            fc1_bias=get("aligner.fc1.bias"),
            fc2=get("aligner.fc2.weight"),
            fc2_bias=get("aligner.fc2.bias"),
        )
