"""The V4.1 vision path: `vision_config`, the DeepSeek-ViT encoder, the aligner, their checkpoint tensors and
the image token layout."""

from .aligner import align, pixel_unshuffle
from .config import VisionConfig, parse_vision_config
from .encoder import axial_rope_angles, encode_image
from .layout import vision_layout
from .tokens import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_PAD,
    IMAGE_START,
    NUM_IMAGE_SENTINELS,
    ImageSentinels,
    ImageSpan,
    compression_stride,
    expand_images,
    image_block,
    image_grid,
    image_positions,
    leading_padding,
)
from .tower import VisionTower
from .weights import VisionBlockWeights, VisionWeights

__all__ = [
    "IMAGE",
    "IMAGE_END",
    "IMAGE_NEW_LINE",
    "IMAGE_PAD",
    "IMAGE_START",
    "NUM_IMAGE_SENTINELS",
    "ImageSentinels",
    "ImageSpan",
    "compression_stride",
    "expand_images",
    "image_block",
    "image_grid",
    "image_positions",
    "leading_padding",
    "VisionBlockWeights",
    "VisionConfig",
    "VisionTower",
    "VisionWeights",
    "align",
    "axial_rope_angles",
    "encode_image",
    "parse_vision_config",
    "pixel_unshuffle",
    "vision_layout",
]
