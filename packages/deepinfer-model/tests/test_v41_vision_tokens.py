"""The image token layout worked by hand: sentinel ids, leading padding at several start positions and
strides, expanded prompts with several images, the per-image budget, and Engram on sentinel ids."""

import pytest
import torch
from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, tiny_v41_config_dict
from deepinfer_model.models.deepseek_v41.engram import EngramHasher
from deepinfer_model.models.deepseek_v41.engram_vocab import CompressedVocabulary
from deepinfer_model.models.deepseek_v41.vision import (
    ImageSentinels,
    ImageSpan,
    compression_stride,
    expand_images,
    image_block,
    image_grid,
    image_positions,
    leading_padding,
)
from deepinfer_model.tokenizer_files import copy_tokenizer
from tokenizers import Tokenizer

S = ImageSentinels(256)  # start 256, pad 257, image 258, newline 259, end 260


def test_sentinel_ids():
    assert (S.start, S.pad, S.image, S.newline, S.end) == (256, 257, 258, 259, 260)
    assert S.is_sentinel(256) and S.is_sentinel(260) and not S.is_sentinel(255) and not S.is_sentinel(261)


def test_compression_stride():
    assert compression_stride((0, 2, 2, 1, 1, 1)) == 2  # the §11 tiny model
    assert compression_stride((0, 0, 0)) == 1
    assert compression_stride((1, 1)) == 1
    assert compression_stride((0, 2, 3)) == 6


@pytest.mark.parametrize(
    "start,stride,pads",
    [(0, 2, 0), (1, 2, 1), (6, 2, 0), (7, 2, 1), (0, 4, 0), (5, 4, 3), (7, 4, 1), (8, 4, 0)],
)
def test_leading_padding(start, stride, pads):
    assert leading_padding(start, stride) == pads
    block = image_block(2, 3, start, stride, S)
    assert len(block) == pads + 2 * (3 + 1) + 2
    assert (start + pads) % stride == 0  # IMAGE_START lands on the stride
    assert block[:pads] == [257] * pads and block[pads] == 256


def test_block_layout():
    assert image_block(2, 3, 0, 2, S) == [256, 258, 258, 258, 259, 258, 258, 258, 259, 260]
    assert image_block(1, 1, 3, 2, S) == [257, 256, 258, 259, 260]
    assert image_positions(2, 3) == 10 and image_positions(1, 1) == 4
    with pytest.raises(ValueError, match="at least one merged cell"):
        image_block(0, 3, 0, 2, S)
    with pytest.raises(ValueError, match="start must be >= 0"):
        leading_padding(-1, 2)


def test_expand_two_images():
    ids, spans = expand_images([[10, 11, 12], [13], []], [(1, 1), (2, 1)], 2, S)
    # image 1 begins at 3 (odd): one pad; text 13 at 8; image 2 begins at 9 (odd): one pad
    assert ids == [10, 11, 12, 257, 256, 258, 259, 260, 13, 257, 256, 258, 259, 258, 259, 260]
    assert spans == [ImageSpan(3, 5, 1, 1), ImageSpan(9, 7, 2, 1)]
    assert [s.start_position for s in spans] == [4, 10] and spans[1].end == 16
    ids, spans = expand_images([[10, 11], [13]], [(1, 2)], 2, S)  # begins at 2 (even): no pad
    assert ids == [10, 11, 256, 258, 258, 259, 260, 13] and spans == [ImageSpan(2, 5, 1, 2)]
    with pytest.raises(ValueError, match="2 images need 3 text segments, got 2"):
        expand_images([[1], [2]], [(1, 1), (1, 1)], 2, S)


@pytest.mark.parametrize(
    "w,h,cell,budget,grid",
    [
        (56, 84, 28, 48, (3, 2)),  # fits as it is
        (1000, 1000, 28, 48, (6, 6)),  # 6 * 7 + 2 = 44 <= 48 < 7 * 8 + 2
        (10000, 10, 28, 48, (1, 45)),  # one row of as many cells as fit: 46 + 2 = 48
        (10, 10000, 28, 48, (23, 1)),  # 23 * 2 + 2 = 48
        (1, 1, 28, 48, (1, 1)),
        (1920, 1080, 42, 1024, (23, 41)),  # V4.1-Flash: 26 x 46 -> 23 x 41 (968 positions; 24 x 43 is 1058)
        (448, 448, 42, 1024, (11, 11)),
    ],
)
def test_image_grid(w, h, cell, budget, grid):
    assert image_grid(w, h, cell, budget) == grid
    assert image_positions(*grid) <= budget


def test_image_grid_rejects_empty():
    with pytest.raises(ValueError, match="at least 1 x 1 pixels, got 0 x 5"):
        image_grid(0, 5, 28, 48)


@pytest.fixture(scope="module")
def hasher(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    copy_tokenizer(d)
    vocab = CompressedVocabulary.from_tokenizer(
        Tokenizer.from_file(str(d / "tokenizer.json")), pad_token_id=2
    )
    cfg = DeepseekV41Config.from_dict(tiny_v41_config_dict())
    return EngramHasher(cfg.engram, vocab, "cpu", text_vocab_size=cfg.vocab_size)


def test_engram_on_sentinels(hasher):
    """Sentinels hash to -1; the n-gram context of text after an image restarts as if the sequence began there
    (the tokenizer is larger than the tiny vocabulary, so without the cap 256.. would be ordinary tokens)."""
    ids = torch.tensor([5, 6, 257, 256, 258, 259, 260, 7, 8])
    rows = hasher.rows(ids)[1]
    assert (rows[2:7] == -1).all() and (rows[[0, 1, 7, 8]] >= 0).all()
    alone = hasher.rows(torch.tensor([7, 8]))[1]
    assert torch.equal(rows[7:], alone)
    assert hasher.vocab.compress(torch.tensor([256, 260, 300])).tolist() == [-1, -1, -1]
    assert int(hasher.vocab.compress(torch.tensor([255]))) >= 0
