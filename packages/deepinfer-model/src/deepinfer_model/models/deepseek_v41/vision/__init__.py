"""The V4.1 vision path: `vision_config`, the DeepSeek-ViT encoder, the aligner and their checkpoint tensors."""

from .aligner import align, pixel_unshuffle
from .config import VisionConfig, parse_vision_config
from .encoder import axial_rope_angles, encode_image
from .layout import vision_layout
from .tower import VisionTower
from .weights import VisionBlockWeights, VisionWeights

__all__ = [
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
