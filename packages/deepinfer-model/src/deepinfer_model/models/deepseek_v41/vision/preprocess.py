"""Image bytes -> the encoder's input: decode (Pillow), resize to the per-image token budget, normalise,
patchify. Runs in worker processes (`workers.py`), so it returns NumPy arrays and touches no torch state.

The grid comes from the image's header alone (`image_size`), so a prompt can be expanded before the pixels
are decoded. Pixels are resized (bicubic) to exactly `rows x cols` merged cells of `patch * merge` pixels,
scaled to [0, 1], normalised per channel by `image_mean` / `image_std`, and cut into patches in row-major
grid order, each patch flattened channel-major (`c, y, x`), the order of `vision.patch_embed.weight`'s
columns.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np

from .config import VisionConfig
from .tokens import image_grid

# Decompression-bomb guard: larger images are refused before their pixels are decoded (Pillow's own
# default warning threshold, 89.5 MP, with headroom for large scans).
MAX_IMAGE_PIXELS = 128 * 1024 * 1024


class ImageError(ValueError):
    """An image that cannot be used; the message names the image and what is wrong with it."""


def image_digest(data: bytes) -> str:
    """Content hash of an encoded image: the key of the encoder cache and of the image's prefix blocks."""
    return hashlib.sha256(data).hexdigest()


def _open(data: bytes, label: str):
    from PIL import Image

    if not isinstance(data, bytes | bytearray | memoryview) or len(data) == 0:
        raise ImageError(f"{label}: no image bytes (got {type(data).__name__} of length {len(data or b'')})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size check below decides
            img = Image.open(io.BytesIO(bytes(data)))
    except Image.DecompressionBombError as e:
        raise ImageError(f"{label}: image exceeds the limit of {MAX_IMAGE_PIXELS} pixels ({e})") from None
    except Exception as e:  # Pillow raises several types for undecodable input
        raise ImageError(f"{label}: cannot decode the image bytes ({type(e).__name__}: {e})") from None
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"{label}: image size must be at least 1 x 1 pixels, got {w} x {h}")
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"{label}: image of {w} x {h} pixels exceeds the limit of {MAX_IMAGE_PIXELS} pixels")
    return img


def image_size(data: bytes, label: str = "image") -> tuple[int, int]:
    """(width, height) from the header, without decoding the pixels."""
    return _open(data, label).size


def image_grid_of(data: bytes, vcfg: VisionConfig, label: str = "image") -> tuple[int, int]:
    """Merged-cell grid `(rows, cols)` the image gets under `vcfg`'s token budget."""
    w, h = image_size(data, label)
    return image_grid(w, h, vcfg.merged_pixels, vcfg.max_image_tokens)


@dataclass(frozen=True)
class PreparedImage:
    """The encoder input of one image: `patches` [patch_rows * patch_cols, C*p*p] float32, row-major."""

    digest: str
    rows: int  # merged cells
    cols: int
    merge: int
    patches: np.ndarray

    @property
    def patch_rows(self) -> int:
        return self.rows * self.merge

    @property
    def patch_cols(self) -> int:
        return self.cols * self.merge


def prepare_image(data: bytes, vcfg: VisionConfig, label: str = "image") -> PreparedImage:
    """Decode, resize, normalise and patchify one encoded image (see the module doc)."""
    from PIL import Image

    img = _open(data, label)
    rows, cols = image_grid(*img.size, vcfg.merged_pixels, vcfg.max_image_tokens)
    try:
        rgb = img.convert("RGB")
    except Exception as e:
        raise ImageError(f"{label}: cannot decode the image pixels ({type(e).__name__}: {e})") from None
    cell, p = vcfg.merged_pixels, vcfg.patch_size
    rgb = rgb.resize((cols * cell, rows * cell), Image.Resampling.BICUBIC)
    x = np.asarray(rgb, dtype=np.float32) / 255.0  # [H, W, C]
    x = (x - np.asarray(vcfg.image_mean, np.float32)) / np.asarray(vcfg.image_std, np.float32)
    pr, pc = rows * vcfg.downsample_ratio, cols * vcfg.downsample_ratio
    patches = x.reshape(pr, p, pc, p, 3).transpose(0, 2, 4, 1, 3).reshape(pr * pc, 3 * p * p)
    return PreparedImage(
        image_digest(bytes(data)), rows, cols, vcfg.downsample_ratio, np.ascontiguousarray(patches)
    )
