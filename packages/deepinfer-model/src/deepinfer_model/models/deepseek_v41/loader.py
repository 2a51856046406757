"""Load a V4.1 checkpoint directory through the shared safetensors loader (spec v41-model §9)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...layers.expert_conversion import convert_experts_if_enabled
from ...loader import load_tensors
from ...runtime.device import resolve_device
from .config import DeepseekV41Config
from .engram_vocab import CompressedVocabulary
from .layout import checkpoint_layout
from .model import DeepseekV41ForCausalLM
from .weights import V41Weights

# Stored but not read: the per-draft-block copies of the embedding / LM head (tied to the backbone's,
# §9.3), and the vision tower of a config that describes none (`vision/config.py`).
_VISION_PREFIXES = ("vision.", "aligner.")


def ignored_prefixes(cfg: DeepseekV41Config) -> tuple[str, ...]:
    tied = tuple(f"mtp.{i}.{n}." for i in range(cfg.num_nextn_predict_layers) for n in ("embed", "head"))
    return tied if cfg.vision else _VISION_PREFIXES + tied


def load_v41(
    path: str | Path,
    act_dtype: torch.dtype = torch.float32,
    quantize_kv: bool = False,
    device: torch.device | str = "cpu",
) -> DeepseekV41ForCausalLM:
    """Validate and load `config.json`, the weights (dequantised to FP32 on `device`) and, with Engram,
    `tokenizer.json`. The model then runs on `device` (every tensor of its forward follows the weights).

    `act_dtype` / `quantize_kv`: see `DeepseekV41ForCausalLM` (FP32 and exact KV by default).
    With `DEEPINFER_FP8_EXPERTS=1` the routed experts are converted to `quant_sm90.Fp8Experts` (run by
    the `grouped_expert_mlp` op, FP8 activation steps included).
    """
    cfg = DeepseekV41Config.from_file(path)
    tensors = load_tensors(
        path,
        cfg,
        checkpoint_layout(cfg),
        torch.float32,
        ignored_prefixes=ignored_prefixes(cfg),
        device=resolve_device(device),
    )
    vocab = CompressedVocabulary.from_file(path) if cfg.engram else None
    weights = V41Weights.from_tensors(cfg, tensors.__getitem__)
    del tensors  # the per-expert tensors: the conversion below frees the stacks it replaces
    # DEEPINFER_FP8_EXPERTS=1: the MXFP4 routed experts (backbone and draft blocks) as 128x128-block FP8
    convert_experts_if_enabled(weights)
    return DeepseekV41ForCausalLM(cfg, weights, vocab, act_dtype, quantize_kv)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> DeepseekV41ForCausalLM:
    """Entry point of `deepinfer_model.load_model` for `model_type: deepseek_v41`; `dtype` = activation dtype."""
    return load_v41(path, act_dtype=dtype, device=device)
