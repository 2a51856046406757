"""Random V4.1 weights in the logical (dequantised) shapes of the checkpoint layout, for tests and demos.

Scales keep activations O(1) through every block, and the mHC biases follow the reference's random-init
layout (§3.1) so the mixes start close to the identity-like schedule the real model uses.
"""

from __future__ import annotations

import math

import torch

from .config import DeepseekV41Config
from .layout import BF16, F32, checkpoint_layout


def random_v41_tensors(
    cfg: DeepseekV41Config, seed: int = 0, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """name -> FP32 tensor for every entry of `checkpoint_layout(cfg)`, made on `device` (a GPU generates
    large checkpoints in seconds; its random stream differs from the CPU's, so the same seed gives other
    values there)."""
    g = torch.Generator(device).manual_seed(seed)
    m = cfg.hc_mult
    out: dict[str, torch.Tensor] = {}
    for spec in checkpoint_layout(cfg).values():
        name, shape = spec.name, spec.shape

        def randn(*s, std=1.0):
            return torch.randn(*s, generator=g, device=device) * std

        if name.endswith("_base") and "hc_" in name:
            base = torch.zeros(shape, device=device)
            layer = int(name.split(".")[1])
            base[:m] = -3.0
            base[layer % m] = 3.0
            comb = torch.full((m, m), -3.0, device=device) + 6.0 * torch.eye(m, device=device)
            base[2 * m :] = comb.flatten()
            t = base + randn(*shape, std=0.5)
        elif name.endswith("_scale") and "hc_" in name:
            t = 0.5 + torch.rand(shape, generator=g, device=device)
        elif "hc_" in name and name.endswith("_fn"):
            t = randn(*shape, std=1.0 / math.sqrt(shape[1]))
        elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "q_weight", "k_weight")):
            t = 1.0 + randn(*shape, std=0.1)
        elif name.endswith("attn_sink"):
            t = randn(*shape)
        elif name.startswith(("vision.", "aligner.")) and name.endswith(".bias"):
            t = randn(*shape, std=0.1)
        elif name.endswith("gate.bias") or name.endswith("gate.bias_vl"):
            t = randn(*shape, std=0.1)
        elif name in ("embed.weight", "image_start", "image_end", "image_newline") or "engram.embed" in name:
            t = randn(*shape)
        elif "markov_head.embed" in name:
            t = randn(*shape)
        else:  # projections: unit-variance outputs for unit-variance inputs
            t = randn(*shape, std=1.0 / math.sqrt(shape[-1]))
        assert spec.kind in (BF16, F32) or len(shape) == 2
        out[name] = t.float()
    return out
