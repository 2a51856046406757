"""Images through the paged V4.1 step: input embeddings at image positions come with the step
(`StepBatch.image_features`), chunked prefill may cut an image block anywhere (the embeddings are per
position), and the logits equal the stateless `forward(ids, image_features=...)` bit for bit."""

import dataclasses

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint, tiny_v41_config_dict
from deepinfer_model.models.deepseek_v41.vision import ImageSentinels, compression_stride, expand_images
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(
        make_v41_checkpoint(tmp_path_factory.mktemp("vp"), tiny_v41_config_dict(vision_tower=True))
    )


def _features(model, seed):
    g = torch.Generator().manual_seed(seed)
    return model.vision.embed_image(torch.rand(16, 588, generator=g) * 2 - 1, 4, 4)


def _prompt(model):
    s = ImageSentinels(model.config.vocab_size)
    stride = compression_stride(model.config.compress_ratios)
    return expand_images([[5, 17, 33], [40, 41, 42, 43, 44], [7, 8]], [(2, 2), (2, 2)], stride, s)


def _image_rows(ids, vocab, feats):
    """Per position: its row in the concatenated features (-1: not an image position)."""
    rows = np.full(len(ids), -1)
    where = np.flatnonzero(np.asarray(ids) == vocab + 2)
    rows[where] = np.arange(len(where))
    return rows, torch.cat(feats)


def _run_chunked(model, ids, feats, cuts):
    runner = PagedRunner(model, 32, BLOCK)
    rows, all_feats = _image_rows(ids, model.config.vocab_size, feats)
    table = np.arange(-(-len(ids) // BLOCK), dtype=np.int64)
    out = []
    for lo, hi in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        r = rows[lo:hi]
        step_feats = all_feats[r[r >= 0]]  # [0, H] for a chunk of pads / start rows only
        batch = StepBatch.of([0], [lo], [hi - lo], [table], np.asarray(ids[lo:hi]), [hi - lo])
        batch = dataclasses.replace(batch, image_features=[step_feats])
        out.append(runner.execute(batch))
    return torch.cat(out)


@pytest.mark.parametrize("cuts", [[], [4], [6, 9], [5, 10, 20], [3, 4, 11, 18, 26]])
def test_paged_chunks_equal_stateless(model, cuts):
    ids, spans = _prompt(model)
    feats = [_features(model, 0), _features(model, 1)]
    ref = model.forward(ids, image_features=feats).logits
    got = _run_chunked(model, ids, feats, cuts)
    # every cut falls inside or at an edge of an image block
    assert all(any(s.offset <= c <= s.end for s in spans) for c in cuts)
    torch.testing.assert_close(got, ref.float(), rtol=0, atol=0)


def test_step_mixing_text_and_image_sequences(model):
    """A text-only sequence beside one with an image: its logits are those it gets alone."""
    ids, _ = _prompt(model)
    feats = [_features(model, 0), _features(model, 1)]
    rows, all_feats = _image_rows(ids, model.config.vocab_size, feats)
    text = [5, 17, 33, 9, 10, 11]
    runner = PagedRunner(model, 32, BLOCK)
    n_img = -(-len(ids) // BLOCK)
    tables = [np.arange(n_img), np.arange(n_img, n_img + 2)]
    batch = StepBatch.of(
        [0, 1], [0, 0], [len(ids), len(text)], tables, np.asarray(ids + text), [len(ids), len(text)]
    )
    batch = dataclasses.replace(batch, image_features=[all_feats[rows[rows >= 0]], None])
    got = runner.execute(batch)
    ref_img = model.forward(ids, image_features=feats).logits
    ref_text = model.forward(text).logits
    torch.testing.assert_close(got[: len(ids)], ref_img.float(), rtol=0, atol=0)
    torch.testing.assert_close(got[len(ids) :], ref_text.float(), rtol=0, atol=0)


def test_step_feature_count_checked(model):
    ids, _ = _prompt(model)
    runner = PagedRunner(model, 32, BLOCK)
    table = np.arange(-(-len(ids) // BLOCK))
    batch = StepBatch.of([0], [0], [len(ids)], [table], np.asarray(ids), [1])
    batch = dataclasses.replace(batch, image_features=[_features(model, 0)])
    with pytest.raises(ValueError, match="8 image positions but the images give 4 feature rows"):
        runner.execute(batch)


@pytest.mark.parametrize("mode", ["mask", "compact"])
@pytest.mark.parametrize("cuts", [[], [6, 9], [5, 10, 20]])
def test_paged_chunks_with_yoco_truncation_equal_stateless(model, mode, cuts):
    """YOCO prefill truncation acts after the embedding: image rows are input rows like any other, and the
    truncated paged prefill (in chunks that cut the image blocks) equals the stateless truncated forward."""
    from deepinfer_model.models.deepseek_v41.yoco import YocoMode, YocoSettings

    keep, backtracking = 14, 6
    ids, _ = _prompt(model)
    feats = [_features(model, 0), _features(model, 1)]
    ref = model.forward(
        torch.as_tensor(ids), image_features=feats, yoco_keep_tokens=keep, yoco_mode=mode,
        yoco_prompt_len=len(ids), backtracking_tokens=backtracking,
    )  # fmt: skip
    runner = PagedRunner(model, 32, BLOCK, yoco=YocoSettings(YocoMode(mode), keep), backtracking=backtracking)
    rows, all_feats = _image_rows(ids, model.config.vocab_size, feats)
    table = np.arange(-(-len(ids) // BLOCK), dtype=np.int64)
    last = []
    for lo, hi in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        r = rows[lo:hi]
        batch = StepBatch.of(
            [0], [lo], [hi - lo], [table], np.asarray(ids[lo:hi]), [1], prompt_lens=[len(ids)]
        )
        last.append(runner.execute(dataclasses.replace(batch, image_features=[all_feats[r[r >= 0]]])))
    torch.testing.assert_close(last[-1][0], ref.logits[-1].float(), rtol=0, atol=0)
    whole = model.forward(ids, image_features=feats).logits[-1]
    assert not torch.equal(ref.logits[-1], whole)  # the truncation is real: it changes the logits
