"""The V4.1 forward with an image: input rows at sentinel positions come from the vision path, text before
the image is untouched (causal), the image changes what follows, and the counts must agree."""

import pytest
import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint, tiny_v41_config_dict
from deepinfer_model.models.deepseek_v41.vision import ImageSentinels, compression_stride, expand_images
from deepinfer_model.models.deepseek_v41.vision.embed import image_input_embeddings


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(
        make_v41_checkpoint(tmp_path_factory.mktemp("v"), tiny_v41_config_dict(vision_tower=True))
    )


def _prompt(model):
    s = ImageSentinels(model.config.vocab_size)
    stride = compression_stride(model.config.compress_ratios)
    return expand_images([[5, 17, 33], [40, 41, 42]], [(2, 2)], stride, s)


def _features(model, seed):
    g = torch.Generator().manual_seed(seed)
    return model.vision.embed_image(torch.rand(16, 588, generator=g) * 2 - 1, 4, 4)


def test_input_rows(model):
    ids, spans = _prompt(model)
    assert ids[3] == 257 and spans[0].start_position == 4  # one pad: the block begins at 3, stride 2
    feats = _features(model, 0)
    w = model.weights
    x = image_input_embeddings(torch.tensor(ids), w.embed, w.image_embeds, 2, [feats], torch.float32)
    assert torch.equal(x[0], w.embed[5].double()) and torch.equal(x[3], w.embed[2].double())
    assert torch.equal(x[4], w.image_embeds[0].double()) and torch.equal(x[7], w.image_embeds[1].double())
    assert torch.equal(x[10], w.image_embeds[1].double()) and torch.equal(x[11], w.image_embeds[2].double())
    assert torch.equal(x[[5, 6, 8, 9]], feats.double()) and torch.equal(x[12], w.embed[40].double())


def test_forward_with_image(model):
    ids, _ = _prompt(model)
    a = model.forward(ids, image_features=[_features(model, 0)]).logits
    b = model.forward(ids, image_features=[_features(model, 1)]).logits
    text = model.forward(ids[:3]).logits
    torch.testing.assert_close(a[:3], text, rtol=0, atol=0)  # causal: the prefix does not see the image
    assert torch.equal(a[:4], b[:4]) and not torch.allclose(a[-1], b[-1])  # the image reaches the last token


def test_counts_and_tower_checked(model, tmp_path):
    ids, _ = _prompt(model)
    with pytest.raises(ValueError, match="4 image positions but the images give 2 feature rows"):
        model.forward(ids, image_features=[_features(model, 0)[:2]])
    with pytest.raises(ValueError, match=r"must lie in \[0, vocab_size \+ 5 = 261\)"):
        model.forward([1, 261], image_features=[])
    text_only = load_v41(make_v41_checkpoint(tmp_path / "t"))
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.forward(ids, image_features=[_features(model, 0)])
