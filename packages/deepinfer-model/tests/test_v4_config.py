"""Config parsing: the HF and upstream spellings of the same model give one internal config."""

from __future__ import annotations

import pytest
from deepinfer_model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, parse_config
from deepinfer_model.testing import tiny_config

transformers = pytest.importorskip("transformers")


def _upstream(cfg: dict) -> dict:
    kinds = {SLIDING: 0, CSA: 4, HCA: 128}
    out = {k: v for k, v in cfg.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types")}
    out["compress_ratios"] = [kinds[k] for k in cfg["layer_types"]] + [0]  # + an MTP entry, ignored
    out["num_hash_layers"] = cfg["mlp_layer_types"].count(HASH_MOE)
    return out


def test_hf_and_upstream_keys_agree():
    hf = tiny_config(compress_rates={CSA: 4, HCA: 128})
    a, b = parse_config(hf), parse_config(_upstream(hf))
    assert a == b
    assert [s.kind for s in a.attention] == [SLIDING, CSA, HCA, CSA]
    assert [s.compress_ratio for s in a.attention] == [0, 4, 128, 4]
    assert a.mlp_layer_types == (HASH_MOE, MOE, MOE, MOE)
    assert a.attention[0].rope.theta == 10000.0 and a.attention[0].rope.yarn is None
    assert a.attention[1].rope.theta == 160000.0 and a.attention[1].rope.yarn.factor == 4.0
    assert a.kv_lora_rank == 16 and not a.hc_shifted and a.q_head_norm


def test_parsing_agrees_with_transformers_config():
    """Same per-layer kinds, hash layers and rope dims as transformers derives from the same dict."""
    raw = _upstream(tiny_config())
    raw["compress_ratios"] = [0, 4, 128, 128, 0]
    ours = parse_config(raw)
    theirs = transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if k != "architectures"})
    assert [s.kind for s in ours.attention] == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.qk_rope_head_dim == theirs.qk_rope_head_dim
    assert [s.compress_ratio for s in ours.attention if s.kind != SLIDING] == [
        theirs.compress_rates[k] for k in theirs.layer_types if k != SLIDING
    ]


def test_defaults_follow_upstream_v4():
    raw = _upstream(tiny_config())
    del raw["num_hash_layers"]
    assert parse_config(raw).n_hash_layers == 3  # upstream default: three hash-routed layers


def test_errors_name_key_value_and_rule():
    with pytest.raises(
        ConfigError, match=r"'compress_rates.heavily_compressed_attention' = 0 must be a positive"
    ):
        parse_config(tiny_config(compress_rates={CSA: 4, HCA: 0}))
    with pytest.raises(ConfigError, match=r"'num_hash_layers' = 9 must be in \[0, num_hidden_layers=4\]"):
        parse_config({**_upstream(tiny_config()), "num_hash_layers": 9})
    with pytest.raises(ConfigError, match=r"'quantization_config.weight_block_size' = \[0, 128\]"):
        parse_config(tiny_config(quantization_config={"quant_method": "fp8", "weight_block_size": [0, 128]}))
    with pytest.raises(ConfigError, match=r"'rope_scaling.factor' is required for YaRN"):
        parse_config(tiny_config(rope_scaling={"type": "yarn", "original_max_position_embeddings": 4}))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse_config([1, 2])
