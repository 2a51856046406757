"""Where an image sits in the token sequence: sentinel ids, the block layout, alignment padding and the grid an
image of a given size gets under the per-image token budget. Pure arithmetic, no tensors.

Sentinel ids lie just past the text vocabulary, `vocab_size + offset` with the reference's offsets
(IMAGE_START 0, IMAGE_PAD 1, IMAGE 2, IMAGE_NEW_LINE 3, IMAGE_END 4), so they never collide with a text
token and the text model has no embedding for them: the model writes aligned image features at IMAGE, the
learned `image_start` / `image_newline` / `image_end` embeddings at the other three, and the text pad
token's embedding at IMAGE_PAD. Engram compresses every sentinel to -1 (no n-gram crosses an image).

An image of `rows x cols` merged cells is the block

    IMAGE_PAD * k, IMAGE_START, (IMAGE * cols, IMAGE_NEW_LINE) * rows, IMAGE_END

of `k + rows * (cols + 1) + 2` ids, where `k = (-start) mod stride` leading pads make IMAGE_START land on
a multiple of the compression stride (`start` = the block's first position), so the compressed KV entries
of an image never mix it with the text before it. The budget counts the `rows * (cols + 1) + 2` positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(5)
NUM_IMAGE_SENTINELS = 5


@dataclass(frozen=True)
class ImageSentinels:
    """The five sentinel ids of a text vocabulary of `vocab_size` tokens."""

    vocab_size: int

    @property
    def start(self) -> int:
        return self.vocab_size + IMAGE_START

    @property
    def pad(self) -> int:
        return self.vocab_size + IMAGE_PAD

    @property
    def image(self) -> int:
        return self.vocab_size + IMAGE

    @property
    def newline(self) -> int:
        return self.vocab_size + IMAGE_NEW_LINE

    @property
    def end(self) -> int:
        return self.vocab_size + IMAGE_END

    def is_sentinel(self, token_id: int) -> bool:
        return self.vocab_size <= token_id < self.vocab_size + NUM_IMAGE_SENTINELS


def compression_stride(compress_ratios) -> int:
    """The alignment an image block needs: the least common multiple of the compressed layers' ratios (1 when
    every layer is sliding-window only)."""
    stride = 1
    for r in compress_ratios:
        if r > 0:
            stride = stride * r // math.gcd(stride, r)
    return stride


def leading_padding(start: int, stride: int) -> int:
    """Pads before IMAGE_START for a block whose first position is `start`."""
    if start < 0 or stride < 1:
        raise ValueError(f"start must be >= 0 and stride >= 1, got start={start}, stride={stride}")
    return -start % stride


def image_positions(rows: int, cols: int) -> int:
    """Positions of an image block without its padding: start, a newline after each row, end."""
    return rows * (cols + 1) + 2


def image_block(rows: int, cols: int, start: int, stride: int, sentinels: ImageSentinels) -> list[int]:
    """The sentinel ids of one image of `rows x cols` merged cells whose block begins at position `start`."""
    if rows < 1 or cols < 1:
        raise ValueError(f"an image needs at least one merged cell per side, got {rows} x {cols}")
    s = sentinels
    ids = [s.pad] * leading_padding(start, stride) + [s.start]
    for _ in range(rows):
        ids += [s.image] * cols + [s.newline]
    return ids + [s.end]


def image_grid(width: int, height: int, cell_pixels: int, max_tokens: int) -> tuple[int, int]:
    """`(rows, cols)` of merged cells for an image of `width x height` pixels: the nearest whole number of
    `cell_pixels` cells per side (at least one), shrunk with the aspect ratio kept as far as whole cells allow
    until `image_positions(rows, cols) <= max_tokens`."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be at least 1 x 1 pixels, got {width} x {height}")
    if max_tokens < image_positions(1, 1):
        raise ValueError(f"max_tokens must be >= {image_positions(1, 1)}, got {max_tokens}")
    rows, cols = max(1, round(height / cell_pixels)), max(1, round(width / cell_pixels))
    if image_positions(rows, cols) <= max_tokens:
        return rows, cols
    # the largest uniform scale that fits: rows from the unscaled count down, columns following the aspect;
    # an image too wide for even one row of that many cells keeps one row of as many cells as fit
    for r in range(rows, 0, -1):
        c = max(1, round(r * width / height))
        if image_positions(r, c) <= max_tokens:
            return r, c
    return 1, max_tokens - 3


@dataclass(frozen=True)
class ImageSpan:
    """One image in an expanded prompt: its block `[offset, offset + length)` (padding included), the grid and
    the position of its IMAGE_START."""

    offset: int
    length: int
    rows: int
    cols: int

    @property
    def start_position(self) -> int:
        return self.offset + self.length - image_positions(self.rows, self.cols)

    @property
    def end(self) -> int:
        return self.offset + self.length


def expand_images(
    segments: list[list[int]], grids: list[tuple[int, int]], stride: int, sentinels: ImageSentinels
) -> tuple[list[int], list[ImageSpan]]:
    """Join text `segments` with one image block between consecutive segments (`len(segments) ==
    len(grids) + 1`): the token ids of the prompt and each image's span."""
    if len(segments) != len(grids) + 1:
        raise ValueError(f"{len(grids)} images need {len(grids) + 1} text segments, got {len(segments)}")
    ids = list(segments[0])
    spans = []
    for (rows, cols), text in zip(grids, segments[1:], strict=True):
        block = image_block(rows, cols, len(ids), stride, sentinels)
        spans.append(ImageSpan(len(ids), len(block), rows, cols))
        ids += block
        ids += text
    return ids, spans
