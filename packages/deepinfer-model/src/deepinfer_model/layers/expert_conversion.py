"""Convert every routed expert block of a loaded model to `quant_sm90.Fp8Experts` (load time).

Kept apart from `quant_sm90` (pure tensor conversions, a leaf) because it walks the model's weight tree
and so needs the layer weight types: `layers.experts` imports `quant_sm90`, never the other way.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..quant_sm90 import ENV, FP8_BLOCK, Fp8ConversionStats, fp8_experts_enabled, fp8_experts_from_weights
from .experts import ExpertWeights
from .moe import MoEWeights

logger = logging.getLogger("deepinfer_model.quant_sm90")


def convert_moe_experts_for_sm90(weights, check: bool = True) -> Fp8ConversionStats:
    """Replace, in place, the `experts` of every `layers.moe.MoEWeights` reachable from `weights` (a model's
    weight dataclass tree: V41Weights, its blocks and drafter) by `Fp8Experts` on the same device.

    Call once after the MXFP4 experts were loaded (dequantised) and moved to the CUDA device; the
    dequantised copies are released as each layer is converted (drop other references to them, e.g. the
    loader's tensor dict, first). Experts whose hidden size is not a multiple of 128 are left as they are
    (warning). Returns the summed conversion stats.
    """
    total = Fp8ConversionStats()
    seen: set[int] = set()

    def walk(obj) -> None:
        nonlocal total
        if id(obj) in seen or isinstance(obj, torch.Tensor):
            return
        seen.add(id(obj))
        if isinstance(obj, MoEWeights):
            if isinstance(obj.experts, ExpertWeights) and obj.experts.w1.shape[-1] % FP8_BLOCK:
                # the activation's 1x128 FP8 groups need H % 128 == 0: these experts keep the torch path
                logger.warning(
                    "experts with hidden size %d (not a multiple of %d) stay dequantised",
                    obj.experts.w1.shape[-1],
                    FP8_BLOCK,
                )
            elif isinstance(obj.experts, ExpertWeights):
                obj.experts = fp8_experts_from_weights(obj.experts, check)
                if obj.experts.stats is not None:
                    total = total.merge(obj.experts.stats)
            return
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)

    walk(weights)
    return total


def convert_experts_if_enabled(weights) -> Fp8ConversionStats | None:
    """At load time, with `DEEPINFER_FP8_EXPERTS=1`: `convert_moe_experts_for_sm90(weights)` (experts
    whose hidden size is not a multiple of 128 keep the default path, with a warning). Returns None when
    the variable is off. The conversion error is not measured here (an FP64 copy of a real model's
    experts would not fit); MXFP4 experts convert exactly when their group scales span <= 14 binades."""
    if not fp8_experts_enabled():
        return None
    stats = convert_moe_experts_for_sm90(weights, check=False)
    logger.info("%s=1: routed experts converted to 128x128-block FP8 (Fp8Experts)", ENV)
    return stats
