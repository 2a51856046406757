"""Write complete random DeepSeek-V4 checkpoints (upstream tensor names) for tests and demos."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig, parse_config
from ..layout import TensorSpec, model_tensors
from ..loader import INDEX_FILE
from ..quant import quant_fp8_block, quant_mxfp4
from ..tokenizer_files import copy_tokenizer

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def tiny_config(**overrides) -> dict:
    """A small public-V4 `config.json` (upstream keys) with every attention and MLP kind; CPU-friendly.

    Layer plan: 0 sliding window (hash MoE), 1 CSA (ratio 4, indexer), 2 HCA (ratio 8), 3 CSA.
    `index_n_heads` is 16 so that indexer scores rarely tie (ties flip top-k between implementations).
    """
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "dtype": "bfloat16",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 3,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    cfg.update(overrides)
    return cfg


def _random_tensor(spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Values on the scale a trained model has, so every path of the forward carries signal."""
    shape, name = spec.shape, spec.name

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    if spec.kind == "index":  # hash routing: k distinct experts per token id
        rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(torch.int32)
    if name == "embed.weight":
        return normal(1.0)
    if name.endswith("norm.weight"):
        return normal(0.1, 1.0)
    if name.endswith("_fn"):
        return normal(2.0 / math.sqrt(shape[1]))
    if name.endswith("_scale"):
        return torch.rand(shape, generator=gen) + 0.5
    if name.endswith("_base"):
        return normal(1.0)
    if name.endswith("attn_sink"):
        return normal(1.0)
    if name.endswith(".ape"):
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.1)
    return normal(1.0 / math.sqrt(shape[-1]))  # projections: unit-variance outputs


def _stored(
    spec: TensorSpec, value: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    q = cfg.quant
    if spec.kind == "f32":
        return {spec.name: value.float()}
    if spec.kind == "index" or spec.kind == "float" or q is None:
        return {spec.name: value if spec.kind == "index" else value.to(dtype)}
    scale_name = spec.name.removesuffix(".weight") + ".scale"
    if spec.kind == "expert" and q.expert_dtype == "fp4":
        packed, scale = quant_mxfp4(value)
    else:
        packed, scale = quant_fp8_block(value, q.weight_block_size)
    return {spec.name: packed, scale_name: scale}


def make_checkpoint(
    path: str | Path,
    config: dict | None = None,
    seed: int = 0,
    *,
    shards: int = 1,
    weight_dtype: str = "bfloat16",
    tokenizer: bool = True,
) -> Path:
    """Write `config.json`, random weights (upstream names, quantised if the config says so) and a tokenizer.

    `shards > 1` splits the tensors over several files plus `model.safetensors.index.json`.
    A `deepseek_v41` config is written by `models.deepseek_v41.make_v41_checkpoint` (always BF16/FP8/FP4).
    Returns the directory.
    """
    if config is not None and config.get("model_type") == "deepseek_v41":
        from ..models.deepseek_v41.checkpoint import make_v41_checkpoint

        return make_v41_checkpoint(path, config, seed, shards=shards, tokenizer=tokenizer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config if config is not None else tiny_config())
    cfg = parse_config(config)
    if weight_dtype not in _TORCH_DTYPES:
        raise ValueError(f"weight_dtype must be one of {sorted(_TORCH_DTYPES)}, got {weight_dtype!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    dtype = _TORCH_DTYPES[weight_dtype]
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for spec in model_tensors(cfg).values():
        tensors.update(_stored(spec, _random_tensor(spec, cfg, gen), cfg, dtype))
    config.setdefault("dtype", weight_dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = list(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n].contiguous() for n in names[s * per : (s + 1) * per]}
            save_file(part, path / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
        index["weight_map"] = weight_map
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer:
        copy_tokenizer(path)
    return path
