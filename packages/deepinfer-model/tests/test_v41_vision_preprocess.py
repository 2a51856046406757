"""Image preprocessing: patches against a naive per-pixel re-derivation, the grid from the header, bad bytes
(undecodable, empty, zero-size, huge) as clear errors, the worker pool with its deadline, the encoder cache."""

import io
import struct
import time
import zlib

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, tiny_v41_config_dict
from deepinfer_model.models.deepseek_v41.vision import (
    EncoderCache,
    ImageError,
    ImagePreprocessor,
    image_digest,
    image_grid_of,
    prepare_image,
)
from PIL import Image

VCFG = DeepseekV41Config.from_dict(
    tiny_v41_config_dict(vision_tower=True)
).vision  # 28-pixel cells, 48 tokens


def _png(w, h, seed=0):
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_header(w, h):
    """A well-formed PNG whose header claims `w x h` pixels, with an empty pixel stream."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(b""))
        + _chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("w,h", [(56, 84), (100, 30), (300, 300)])
def test_patches_match_naive(w, h):
    data = _png(w, h, seed=w)
    got = prepare_image(data, VCFG)
    rows, cols = image_grid_of(data, VCFG)
    assert (got.rows, got.cols) == (rows, cols) and got.digest == image_digest(data)
    resized = np.asarray(
        Image.open(io.BytesIO(data)).convert("RGB").resize((cols * 28, rows * 28), Image.Resampling.BICUBIC)
    )
    p = 14
    assert got.patches.shape == (rows * 2 * cols * 2, 3 * p * p)
    for idx in (0, 1, cols * 2, got.patches.shape[0] - 1):
        pr, pc = divmod(idx, cols * 2)
        want = [
            (resized[pr * p + y, pc * p + x, c] / 255.0 - 0.5) / 0.5
            for c in range(3)
            for y in range(p)
            for x in range(p)
        ]
        np.testing.assert_allclose(got.patches[idx], want, rtol=0, atol=1e-6)


def test_budget_resize():
    img = prepare_image(_png(1000, 600), VCFG)  # 21 x 36 cells unscaled; 5 x round(8.33) = 47 positions
    assert img.rows * (img.cols + 1) + 2 <= 48 and (img.rows, img.cols) == (5, 8)


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"not an image at all", "image 3: cannot decode the image bytes"),
        (b"", "image 3: no image bytes"),
        (None, "image 3: no image bytes"),
        (_png_header(20000, 20000), "image 3: image exceeds the limit of 134217728 pixels"),
        (_png_header(12000, 12000), "image 3: image of 12000 x 12000 pixels exceeds the limit of 134217728"),
        (_png_header(0, 5), "image 3: "),
        (_png_header(8, 8), "image 3: cannot decode the image pixels"),  # header only, no pixel data
    ],
)
def test_bad_images(data, needle):
    with pytest.raises(ImageError, match=needle):
        prepare_image(data, VCFG, "image 3")


def test_worker_pool_and_deadline():
    good = [_png(60, 40, 1), _png(30, 90, 2)]
    pre = ImagePreprocessor(VCFG, workers=2, timeout_s=120)
    try:
        out = pre.prepare([good[0], b"garbage", good[1]])
        assert isinstance(out[1], ImageError) and "image 1: cannot decode" in str(out[1])
        for got, data in zip([out[0], out[2]], good, strict=True):
            want = prepare_image(data, VCFG)
            assert (got.rows, got.cols, got.digest) == (want.rows, want.cols, want.digest)
            np.testing.assert_array_equal(got.patches, want.patches)
        # decoding 64 M pixels takes a worker far longer than 0.1 ms, however the threads are scheduled
        buf = io.BytesIO()
        Image.new("RGB", (8000, 8000), (40, 80, 120)).save(buf, format="PNG")
        pre.timeout_s = 1e-4
        late = pre.prepare([buf.getvalue()])
        assert isinstance(late[0], ImageError) and "did not finish within 0.0001 s" in str(late[0])
        assert pre._pool is None  # replaced
        pre.timeout_s = 120
        again = pre.prepare([good[0]])
        np.testing.assert_array_equal(again[0].patches, out[0].patches)
    finally:
        pre.close()


def test_deadline_is_on_progress_so_a_long_batch_finishes():
    """Like the reference's worker timeout, the deadline is on progress: a batch taking far longer than
    the timeout in all succeeds while the worker keeps finishing images (the offline engine prepares every
    request's images in one batch). One worker, 24 images of ~0.2 s each against a 2 s timeout."""
    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000), (40, 80, 120)).save(buf, format="PNG")
    slow = buf.getvalue()
    pre = ImagePreprocessor(VCFG, workers=1, timeout_s=120)
    try:
        pre.prepare([_png(30, 30)])  # the worker is up: its start is not what the timeout is about
        pre.timeout_s = 2.0
        seen = []
        t0 = time.monotonic()
        out = pre.prepare([slow] * 24, on_done=seen.append)
        took = time.monotonic() - t0
        assert not any(isinstance(o, ImageError) for o in out), [
            str(o) for o in out if isinstance(o, ImageError)
        ]
        assert sum(seen) == 24
        assert took > pre.timeout_s  # the batch did outlast the timeout (else the test shows nothing)
        assert pre._pool is not None  # nothing was stuck
    finally:
        pre.close()


def test_encoder_cache_lru():
    c = EncoderCache(max_rows=10)
    c.put("a", torch.zeros(4, 2))
    c.put("b", torch.zeros(4, 2))
    assert c.get("a") is not None  # a is now the most recent
    c.put("c", torch.zeros(4, 2))  # 12 rows > 10: b (least recent) goes
    assert "b" not in c and "a" in c and "c" in c and len(c) == 2
    assert c.get("b") is None and (c.hits, c.misses) == (1, 1)
