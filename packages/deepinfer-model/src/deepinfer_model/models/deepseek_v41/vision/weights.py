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
