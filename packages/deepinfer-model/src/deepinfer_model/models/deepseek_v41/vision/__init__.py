"""The V4.1 vision path: `vision_config`, the DeepSeek-ViT encoder, the aligner, their checkpoint tensors and
the image token layout."""

from .aligner import align, pixel_unshuffle
from .config import VisionConfig, parse_vision_config
from .encoder import (
    ATTENTION_MODES,
    axial_rope_angles,
    default_dtype,
    encode_image,
    fused_attention,
    reference_attention,
    residual_dtype,
    resolve_attention,
)
from .encoder_cache import EncoderCache
from .layout import vision_layout
from .preprocess import (
    MAX_IMAGE_PIXELS,
    ImageError,
    PreparedImage,
    image_digest,
    image_grid_of,
    image_size,
    prepare_image,
)
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
from .workers import ImagePreprocessor

__all__ = [
    "ATTENTION_MODES",
    "IMAGE",
    "IMAGE_END",
    "IMAGE_NEW_LINE",
    "IMAGE_PAD",
    "IMAGE_START",
    "NUM_IMAGE_SENTINELS",
    "EncoderCache",
    "ImageError",
    "ImagePreprocessor",
    "ImageSentinels",
    "MAX_IMAGE_PIXELS",
    "PreparedImage",
    "ImageSpan",
    "compression_stride",
    "expand_images",
    "image_block",
    "image_digest",
    "image_grid_of",
    "image_size",
    "prepare_image",
    "image_grid",
    "image_positions",
    "leading_padding",
    "VisionBlockWeights",
    "VisionConfig",
    "VisionTower",
    "VisionWeights",
    "align",
    "axial_rope_angles",
    "default_dtype",
    "encode_image",
    "fused_attention",
    "parse_vision_config",
    "pixel_unshuffle",
    "reference_attention",
    "residual_dtype",
    "resolve_attention",
    "vision_layout",
]
