"""Tensors of the vision tower in a V4.1 checkpoint, under the spec's `vision.` and `aligner.` prefixes.

The spec names only the prefixes; the names below them are ours, one per parameter of the encoder and
aligner the issue describes. All are BF16 (`float` kind) in the checkpoint:

    vision.patch_embed.weight / .bias       [W, 3*p*p] / [W]   linear patch embedding (channel-major patches)
    vision.blocks.{i}.norm1.weight          [W]                pre-attention RMSNorm
    vision.blocks.{i}.attn.qkv.weight/.bias [3W, W] / [3W]     fused q, k, v (in that order), with bias
    vision.blocks.{i}.attn.proj.weight      [W, W]             output projection, no bias
    vision.blocks.{i}.norm2.weight          [W]                pre-MLP RMSNorm
    vision.blocks.{i}.mlp.w13.weight        [2I, W]            packed SwiGLU: gate rows then up rows, no bias
    vision.blocks.{i}.mlp.w2.weight         [W, I]             down projection, no bias
    vision.norm.weight                      [W]                final RMSNorm
    aligner.fc1.weight / .bias              [d, r*r*W] / [d]   after the r x r pixel-unshuffle
    aligner.fc2.weight / .bias              [d, d] / [d]
"""

from __future__ import annotations

from ....layout import TensorSpec
from .config import VisionConfig

_FLOAT = "float"


def vision_layout(vcfg: VisionConfig, text_hidden: int) -> list[TensorSpec]:
    W, inter, r, d = vcfg.hidden_size, vcfg.intermediate_size, vcfg.downsample_ratio, text_hidden
    specs = [
        TensorSpec("vision.patch_embed.weight", (W, vcfg.patch_dim), _FLOAT),
        TensorSpec("vision.patch_embed.bias", (W,), _FLOAT),
    ]
    for i in range(vcfg.num_hidden_layers):
        p = f"vision.blocks.{i}."
        specs += [
            TensorSpec(p + "norm1.weight", (W,), _FLOAT),
            TensorSpec(p + "attn.qkv.weight", (3 * W, W), _FLOAT),
            TensorSpec(p + "attn.qkv.bias", (3 * W,), _FLOAT),
            TensorSpec(p + "attn.proj.weight", (W, W), _FLOAT),
            TensorSpec(p + "norm2.weight", (W,), _FLOAT),
            TensorSpec(p + "mlp.w13.weight", (2 * inter, W), _FLOAT),
            TensorSpec(p + "mlp.w2.weight", (W, inter), _FLOAT),
        ]
    specs += [
        TensorSpec("vision.norm.weight", (W,), _FLOAT),
        TensorSpec("aligner.fc1.weight", (d, r * r * W), _FLOAT),
        TensorSpec("aligner.fc1.bias", (d,), _FLOAT),
        TensorSpec("aligner.fc2.weight", (d, d), _FLOAT),
        TensorSpec("aligner.fc2.bias", (d,), _FLOAT),
    ]
    return specs
