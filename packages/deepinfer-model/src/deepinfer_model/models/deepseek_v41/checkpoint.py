"""Write a complete random V4.1 checkpoint (HF layout of §9.3, quantised as the reference ships it).

FP8 E4M3 projections with 32x32 UE8M0 block scales, MXFP4 routed experts, a row-scaled FP8 Engram
table, the drafter's `mtp.*` tensors, BF16 / FP32 for everything else, plus the real DeepSeek-V4
tokenizer (Engram builds its compressed vocabulary from it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...loader import INDEX_FILE
from ...quant import quant_fp8_block, quant_mxfp4
from ...tokenizer_files import copy_tokenizer
from .config import DeepseekV41Config
from .layout import BF16, F32, FP4, FP8_ROWS, checkpoint_layout
from .random_weights import random_v41_tensors
from .tiny import tiny_v41_config_dict


def quantised_v41_tensors(cfg: DeepseekV41Config, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored tensors (name -> tensor, `.scale` companions included) for logical FP32 `values`."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in checkpoint_layout(cfg).items():
        v = values[name]
        if spec.kind == F32:
            out[name] = v.float()
        elif spec.kind == BF16:
            out[name] = v.to(torch.bfloat16)
        else:
            if spec.kind == FP4:
                packed, scale = quant_mxfp4(v)
            else:
                packed, scale = quant_fp8_block(
                    v, (1, 32) if spec.kind == FP8_ROWS else cfg.quant.weight_block_size
                )
            out[name] = packed
            out[name.removesuffix(".weight") + ".scale"] = scale
    return out


def make_v41_checkpoint(
    path: str | Path,
    config: dict | None = None,
    seed: int = 0,
    *,
    shards: int = 1,
    tokenizer: bool = True,
    device: torch.device | str = "cpu",
) -> Path:
    """Write `config.json` (default: the §11 tiny config), random quantised weights and the tokenizer.
    `device`: where the weights are drawn and quantised (see `random_v41_tensors`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config if config is not None else tiny_v41_config_dict()
    cfg = DeepseekV41Config.from_dict(config)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    tensors = quantised_v41_tensors(cfg, random_v41_tensors(cfg, seed, device))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        file = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous().cpu() for n in names[s * per : (s + 1) * per]}
        save_file(part, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    if shards > 1:
        (path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}, indent=2) + "\n")
    if tokenizer:
        copy_tokenizer(path)
    return path
