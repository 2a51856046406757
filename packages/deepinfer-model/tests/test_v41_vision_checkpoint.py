"""`vision_config` parsing, the vision tower's checkpoint tensors (writer -> loader), and that a config
without a tower keeps its text-only layout, random values and loading exactly as before."""

import json

import pytest
import torch
from deepinfer_model.models.deepseek_v41 import (
    DeepseekV41Config,
    checkpoint_layout,
    load_v41,
    make_v41_checkpoint,
    random_v41_tensors,
    tiny_v41_config_dict,
)


def _vision(**keys):
    d = tiny_v41_config_dict(vision_tower=True)
    d["vision_config"].update(keys)
    return d


def test_tiny_vision_config_parses():
    v = DeepseekV41Config.from_dict(tiny_v41_config_dict(vision_tower=True)).vision
    assert (v.hidden_size, v.downsample_ratio, v.num_hidden_layers, v.head_dim) == (64, 2, 2, 16)
    assert v.patch_dim == 3 * 14 * 14 and v.merged_pixels == 28 and v.max_image_tokens == 48
    assert DeepseekV41Config.from_dict(tiny_v41_config_dict()).vision is None  # projector keys only


@pytest.mark.parametrize(
    "keys,needles",
    [
        ({"num_attention_heads": 5}, ["vision_config.num_attention_heads", "divide hidden_size = 64"]),
        ({"num_attention_heads": 32}, ["vision_config.num_attention_heads", "multiple of 4"]),
        ({"intermediate_size": 0}, ["vision_config.intermediate_size", "integer >= 1"]),
        ({"max_image_tokens": 3}, ["vision_config.max_image_tokens", "integer >= 4"]),
        ({"image_std": [0.5, 0, 0.5]}, ["vision_config.image_std", "3 numbers > 0"]),
        ({"rope_theta": -1}, ["vision_config.rope_theta", "number > 0"]),
        ({"num_channels": 1}, ["vision_config.num_channels", "must be 3"]),
    ],
)
def test_bad_vision_config(keys, needles):
    with pytest.raises(ValueError) as e:
        DeepseekV41Config.from_dict(_vision(**keys))
    for n in needles:
        assert n in str(e.value)


def test_missing_key_names_it():
    d = _vision()
    del d["vision_config"]["intermediate_size"]
    with pytest.raises(ValueError, match="'vision_config.intermediate_size' is missing"):
        DeepseekV41Config.from_dict(d)


def test_text_only_layout_and_values_unchanged():
    plain = DeepseekV41Config.from_dict(tiny_v41_config_dict())
    vis = DeepseekV41Config.from_dict(tiny_v41_config_dict(vision_tower=True))
    lp, lv = checkpoint_layout(plain), checkpoint_layout(vis)
    assert not any(n.startswith(("vision.", "aligner.")) for n in lp)
    assert list(lv)[: len(lp)] == list(lp)  # the tower's tensors come after every text tensor
    extra = [n for n in lv if n not in lp]
    assert extra[0] == "vision.patch_embed.weight" and extra[-1] == "aligner.fc2.bias"
    assert lv["aligner.fc1.weight"].shape == (128, 4 * 64) and lv["vision.blocks.1.mlp.w13.weight"].shape == (
        192,
        64,
    )
    a, b = random_v41_tensors(plain, seed=3), random_v41_tensors(vis, seed=3)
    for n in lp:
        assert torch.equal(a[n], b[n]), n


def test_writer_loader_round_trip(tmp_path):
    cfg_dict = tiny_v41_config_dict(vision_tower=True)
    path = make_v41_checkpoint(tmp_path / "v", cfg_dict, seed=4)
    model = load_v41(path)
    cfg = model.config
    values = random_v41_tensors(cfg, seed=4)
    w = model.weights.vision
    assert torch.equal(w.patch_embed, values["vision.patch_embed.weight"].to(torch.bfloat16).float())
    assert torch.equal(
        w.blocks[1].qkv_bias, values["vision.blocks.1.attn.qkv.bias"].to(torch.bfloat16).float()
    )
    assert torch.equal(w.fc2, values["aligner.fc2.weight"].to(torch.bfloat16).float())
    emb = model.weights.image_embeds
    assert torch.equal(emb[1], values["image_newline"].to(torch.bfloat16).float())
    assert model.vision is not None and model.vision.config == cfg.vision


def test_text_only_checkpoint_ignores_tower_tensors(tmp_path):
    """A checkpoint that stores the tower but whose config describes none loads as the text model."""
    path = make_v41_checkpoint(tmp_path / "v", tiny_v41_config_dict(vision_tower=True), seed=4)
    text_only = tiny_v41_config_dict()
    (path / "config.json").write_text(json.dumps(text_only))
    model = load_v41(path)
    assert model.vision is None and model.weights.vision is None and model.weights.image_embeds is None


def test_tower_config_needs_tower_tensors(tmp_path):
    path = make_v41_checkpoint(tmp_path / "t", tiny_v41_config_dict(), seed=4)
    (path / "config.json").write_text(json.dumps(tiny_v41_config_dict(vision_tower=True)))
    with pytest.raises(Exception, match="missing tensor 'vision.patch_embed.weight'"):
        load_v41(path)
