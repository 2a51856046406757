"""The whole public DeepSeek-V4 against transformers 5.24 (independent implementation), FP32, 1e-5 relative.

transformers reads our checkpoint files itself (upstream names, its own renaming), so the test also
checks the tensor layout the writer produces and the loader expects.
"""

from __future__ import annotations

import json

import pytest
import torch
from deepinfer_model import load_config, load_model
from deepinfer_model.layout import model_tensors
from deepinfer_model.loader import load_tensors
from deepinfer_model.testing import make_checkpoint, tiny_config
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")


RTOL = 1e-5


def _hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    transformers.logging.set_verbosity_error()
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    # every tensor we wrote must be consumed, and nothing transformers needs may be missing
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < RTOL, f"max relative deviation {err:.2e} >= {RTOL}"


CONFIGS = {
    # sliding / CSA (indexer top-3 of up to 10 entries) / HCA ratio 8 / CSA; hash-routed first layer; YaRN
    "all-kinds": (tiny_config(), 40),
    # upstream spelling: compress_ratios with the real HCA ratio 128 (needs > 128 tokens), no YaRN, hc_mult 2,
    # 8 heads in 4 output groups, two hash-routed layers, top-3 experts of 6
    "upstream-keys": (
        {
            k: v
            for k, v in tiny_config(
                num_hidden_layers=3,
                compress_ratios=[128, 4, 0, 0],
                num_hash_layers=2,
                hc_mult=2,
                num_attention_heads=8,
                o_groups=4,
                n_routed_experts=6,
                num_experts_per_tok=3,
                index_topk=16,
                sliding_window=16,
            ).items()
            if k not in ("layer_types", "compress_rates", "mlp_layer_types", "rope_scaling")
        },
        140,
    ),
    # HF spelling with nested rope_parameters; every layer compressed; top-k larger than the entry count
    "hf-keys-dense-topk": (
        {
            k: v
            for k, v in tiny_config(
                num_hidden_layers=2,
                layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 2},
                mlp_layer_types=["moe", "hash_moe"],
                index_topk=64,
                rope_parameters={
                    "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
                    "compress": {
                        "rope_type": "yarn",
                        "rope_theta": 80000.0,
                        "factor": 8.0,
                        "original_max_position_embeddings": 64,
                        "beta_fast": 16,
                        "beta_slow": 2,
                        "attention_factor": 1.0,
                        "partial_rotary_factor": 0.5,
                    },
                },
            ).items()
            if k not in ("rope_scaling", "rope_theta", "compress_rope_theta", "qk_rope_head_dim")
        },
        33,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    config, length = CONFIGS[name]
    path = make_checkpoint(tmp_path / name, config, seed=len(name))
    ids = torch.randint(0, config["vocab_size"], (length,), generator=torch.Generator().manual_seed(7))
    ours = load_model(path).forward(ids)
    _assert_close(ours, _hf_logits(path, ids))


def test_quantised_checkpoint_matches_transformers_on_dequantised_weights(tmp_path):
    """FP8 block-scaled projections and MXFP4 experts: our dequantise-then-forward equals transformers run
    on the same dequantised values (transformers has no CPU FP8/FP4 path, so it gets them in F32)."""
    config = tiny_config(
        quantization_config={
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [16, 16],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        }
    )
    qpath = make_checkpoint(tmp_path / "q", config, seed=3)
    cfg = load_config(qpath)
    tensors = load_tensors(qpath, cfg, model_tensors(cfg))
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, plain / "model.safetensors")
    hf_config = {k: v for k, v in config.items() if k != "quantization_config"}
    (plain / "config.json").write_text(json.dumps(hf_config))
    ids = torch.randint(0, config["vocab_size"], (36,), generator=torch.Generator().manual_seed(11))
    _assert_close(load_model(qpath).forward(ids), _hf_logits(plain, ids))
