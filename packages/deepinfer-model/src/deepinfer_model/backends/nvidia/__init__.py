"""NVIDIA (Hopper, SM90) backend: registers the ops whose libraries import on this machine.

| op | implementation |
| --- | --- |
| rms_norm | TileLang kernel (`tilelang_norm.py`); torch FP32 if TileLang is missing |
| apply_rope, hc_mixes, hc_read, hc_write | torch FP32 on the GPU (`torch_cuda.py`) |
| fp8_block_linear | DeepGEMM `fp8_gemm_nt` if `deep_gemm` imports and `DEEPINFER_DEEP_GEMM` != 0, else dequantise + BF16 GEMM |
| sparse_decode_attention | torch FP32 gather + softmax with sink (FlashMLA's SM90 kernel rejects the V41 format) |
| kv_store_fp8 | not registered: the device-agnostic torch reference serves it |

A missing optional library is logged once and its op falls back as listed.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from ...ops.registry import register
from . import gemm, torch_cuda

logger = logging.getLogger("deepinfer_model.ops")


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


if _has("tilelang"):
    from . import tilelang_norm

    register("nvidia", "rms_norm")(tilelang_norm.rms_norm)
else:
    logger.warning("tilelang is not installed: rms_norm uses the torch FP32 implementation")
    register("nvidia", "rms_norm")(torch_cuda.rms_norm)

register("nvidia", "apply_rope")(torch_cuda.apply_rope)
register("nvidia", "hc_mixes")(torch_cuda.hc_mixes)
register("nvidia", "hc_read")(torch_cuda.hc_read)
register("nvidia", "hc_write")(torch_cuda.hc_write)

if _has("deep_gemm") and os.environ.get("DEEPINFER_DEEP_GEMM", "1") != "0":
    register("nvidia", "fp8_block_linear")(gemm.fp8_block_linear_deep_gemm)
else:
    logger.warning("deep_gemm unavailable or disabled: fp8_block_linear dequantises to a BF16 GEMM")
    register("nvidia", "fp8_block_linear")(gemm.fp8_block_linear_dequant)

# FlashMLA's SM90 (legacy) sparse decode supports the V3.2 and V4 cache formats but not V41's 528-byte
# one (measured on an H200, 2026-11-29: "required but not supported: V41_KVCACHE_FORMAT"), so
# `attention.py` is kept for a V4-format cache and the torch path serves the op for now.
register("nvidia", "sparse_decode_attention")(torch_cuda.sparse_decode_attention)
