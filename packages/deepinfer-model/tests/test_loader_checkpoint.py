"""Checkpoint round trip and every documented loader / config error."""

from __future__ import annotations

import json

import pytest
import torch
from deepinfer_model import CheckpointError, ConfigError, load_model
from deepinfer_model.testing import make_checkpoint, tiny_config
from safetensors.torch import load_file, save_file

SMALL = dict(
    num_hidden_layers=2,
    layer_types=["sliding_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe"],
    n_routed_experts=4,
)
IDS = torch.tensor([3, 17, 90, 4, 4, 100, 5, 6, 7, 8, 9, 11, 60, 1])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ck"), tiny_config(**SMALL), seed=2)


def _copy(src, dst, tensors=None, config=None):
    dst.mkdir()
    save_file(
        tensors if tensors is not None else load_file(src / "model.safetensors"), dst / "model.safetensors"
    )
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_round_trip_is_bitwise_and_sharding_does_not_matter(ckpt, tmp_path):
    a = load_model(ckpt).forward(IDS)
    b = load_model(ckpt).forward(IDS)
    assert torch.equal(a, b)
    sharded = make_checkpoint(tmp_path / "sharded", tiny_config(**SMALL), seed=2, shards=3)
    assert (
        len(list(sharded.glob("*.safetensors"))) == 3 and (sharded / "model.safetensors.index.json").exists()
    )
    assert torch.equal(load_model(sharded).forward(IDS), a)
    assert (ckpt / "tokenizer.json").exists() and (ckpt / "tokenizer_config.json").exists()


def test_model_prefix_is_accepted(ckpt, tmp_path):
    tensors = {"model." + k: v for k, v in load_file(ckpt / "model.safetensors").items()}
    path = _copy(ckpt, tmp_path / "prefixed", tensors)
    assert torch.equal(load_model(path).forward(IDS), load_model(ckpt).forward(IDS))


def test_bf16_model_rounds_activations(ckpt):
    f32 = load_model(ckpt).forward(IDS)
    bf16 = load_model(ckpt, dtype=torch.bfloat16).forward(IDS)
    assert bf16.dtype == torch.float32 and not torch.equal(f32, bf16)
    assert ((f32 - bf16).abs().max() / f32.abs().max()) < 0.1
    with pytest.raises(ValueError, match="dtype"):
        load_model(ckpt, dtype=torch.float16)


def test_all_problems_reported_at_once(ckpt, tmp_path):
    t = load_file(ckpt / "model.safetensors")
    del t["layers.0.attn.wq_a.weight"]  # missing
    t["layers.1.attn.kv_norm.weight"] = t["layers.1.attn.kv_norm.weight"][:-1].clone()  # wrong shape
    t["layers.0.attn.attn_sink"] = t["layers.0.attn.attn_sink"].to(torch.bfloat16)  # must be F32
    t["layers.1.ffn.gate.weight"] = t["layers.1.ffn.gate.weight"].to(torch.int32)  # not a float
    t["layers.0.attn.bogus"] = torch.zeros(3)  # unexpected
    path = _copy(ckpt, tmp_path / "broken", t)
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    problems = e.value.problems
    assert len(problems) == 5, problems
    text = str(e.value)
    assert "missing tensor 'layers.0.attn.wq_a.weight': expected BF16/F16/F32 [32, 64]" in text
    assert "tensor 'layers.1.attn.kv_norm.weight': expected shape [32], found [31]" in text
    assert "tensor 'layers.0.attn.attn_sink': expected dtype F32, found BF16" in text
    assert "tensor 'layers.1.ffn.gate.weight': expected dtype BF16/F16/F32, found I32" in text
    assert "unexpected tensor 'layers.0.attn.bogus'" in text


def test_mtp_tensors_are_ignored(ckpt, tmp_path):
    t = load_file(ckpt / "model.safetensors")
    t["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)
    assert torch.equal(
        load_model(_copy(ckpt, tmp_path / "mtp", t)).forward(IDS), load_model(ckpt).forward(IDS)
    )


def test_corrupted_file(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path / "corrupt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(b"\xff" * 8 + data[8:100])
    with pytest.raises(CheckpointError, match="'model.safetensors' is not a readable safetensors file"):
        load_model(path)


def test_truncated_file(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path / "trunc")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_model(path)


def test_sharded_index_errors(tmp_path):
    path = make_checkpoint(tmp_path / "sh", tiny_config(**SMALL), seed=1, shards=2, tokenizer=False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    index["weight_map"]["layers.0.attn.extra.weight"] = sorted(set(index["weight_map"].values()))[0]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    text = str(e.value)
    assert f"shard '{shard}' listed in model.safetensors.index.json does not exist" in text
    assert "tensor 'layers.0.attn.extra.weight' is indexed in shard" in text
    assert "missing tensor" in text  # the tensors of the deleted shard


def test_quantised_dtypes_are_checked(tmp_path):
    q = {"quant_method": "fp8", "weight_block_size": [16, 16], "expert_dtype": "fp4"}
    path = make_checkpoint(
        tmp_path / "q", tiny_config(**SMALL, quantization_config=q), seed=4, tokenizer=False
    )
    t = load_file(path / "model.safetensors")
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.attn.wq_a.scale"].shape == (2, 4)
    assert t["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert t["layers.0.ffn.experts.0.w1.weight"].shape == (32, 32)
    assert t["layers.0.ffn.experts.0.w1.scale"].shape == (32, 2)
    load_model(path).forward(IDS)
    t["layers.0.attn.wq_a.weight"] = t["layers.0.attn.wq_a.weight"].float()
    del t["layers.1.ffn.experts.3.w2.scale"]
    (path / "model.safetensors").unlink()
    save_file(t, path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert "tensor 'layers.0.attn.wq_a.weight': expected dtype F8_E4M3, found F32" in str(e.value)
    assert "missing tensor 'layers.1.ffn.experts.3.w2.scale': expected F8_E8M0 [64, 1]" in str(e.value)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "llama"}, "'model_type' = 'llama' must be one of"),
        ({"hidden_size": 0}, "'hidden_size' = 0 must be a positive integer"),
        ({"hidden_size": "64"}, "'hidden_size' = '64' must be of type int"),
        ({"o_groups": 3}, "'o_groups' = 3 must divide num_attention_heads = 4"),
        ({"num_experts_per_tok": 9}, "'num_experts_per_tok' = 9 must be <= n_routed_experts = 4"),
        ({"layer_types": ["sliding_attention"]}, "'layer_types' has 1 entries; needs num_hidden_layers = 2"),
        ({"layer_types": ["sliding_attention", "full"]}, "'layer_types[1]' = 'full' must be one of"),
        ({"mlp_layer_types": ["moe", "dense"]}, "'mlp_layer_types[1]' = 'dense' must be one of"),
        ({"num_key_value_heads": 2}, "'num_key_value_heads' = 2 must be 1"),
        ({"scoring_func": "softmax"}, "'scoring_func' = 'softmax' must be 'sqrtsoftplus'"),
        ({"qk_rope_head_dim": 15}, "'qk_rope_head_dim' = 15 must be even"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "'rope_scaling.type' = 'linear' must be 'yarn'"),
        ({"quantization_config": {"quant_method": "awq"}}, "'quantization_config.quant_method' = 'awq'"),
        ({"num_hidden_layers": None}, "'num_hidden_layers' is required"),
        ({"tie_word_embeddings": True}, "'tie_word_embeddings' = True must be false"),
    ],
)
def test_invalid_config(ckpt, tmp_path, change, message):
    path = _copy(ckpt, tmp_path / "cfg", config=change)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_model(path)


def test_upstream_ratio_list_is_validated(ckpt, tmp_path):
    cfg = {"layer_types": None, "compress_ratios": [0, 16]}
    with pytest.raises(ConfigError, match=r"'compress_ratios\[1\]' = 16 must be one of 0, 4, 128"):
        load_model(_copy(ckpt, tmp_path / "r", config=cfg))


def test_hash_table_ids_out_of_range(ckpt, tmp_path):
    t = load_file(ckpt / "model.safetensors")
    t["layers.0.ffn.gate.tid2eid"][0, 0] = 4
    with pytest.raises(CheckpointError, match=r"expert ids must lie in \[0, 4\)"):
        load_model(_copy(ckpt, tmp_path / "h", t))


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")


@pytest.mark.parametrize("expert_dtype,scale_fmt", [("fp8", "ue8m0"), ("fp4", "ue8m0"), ("fp8", "float")])
def test_quantised_forward_equals_forward_on_dequantised_f32_copy(tmp_path, expert_dtype, scale_fmt):
    from deepinfer_model import load_config
    from deepinfer_model.layout import model_tensors
    from deepinfer_model.loader import load_tensors
    from deepinfer_model.quant import ue8m0_to_float

    q = {
        "quant_method": "fp8",
        "weight_block_size": [32, 16],
        "expert_dtype": expert_dtype,
        "scale_fmt": scale_fmt,
    }
    path = make_checkpoint(
        tmp_path / "q", tiny_config(**SMALL, quantization_config=q), seed=6, tokenizer=False
    )
    if scale_fmt == "float":  # FP32 block scales are accepted too
        t = load_file(path / "model.safetensors")
        t = {k: ue8m0_to_float(v) if k.endswith(".scale") else v for k, v in t.items()}
        save_file(t, path / "model.safetensors")
    cfg = load_config(path)
    tensors = load_tensors(path, cfg, model_tensors(cfg))
    plain_cfg = {
        k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "quantization_config"
    }
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, plain / "model.safetensors")
    (plain / "config.json").write_text(json.dumps(plain_cfg))
    assert torch.equal(load_model(path).forward(IDS), load_model(plain).forward(IDS))
