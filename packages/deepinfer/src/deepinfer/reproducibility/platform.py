"""Which platform key a baseline belongs to: `cpu`, or `nvidia-sm<major><minor>` (e.g. `nvidia-sm90`).

Numerics differ between platforms (kernels, reduction orders), never between runs on one platform, so
baselines are keyed by platform rather than by machine or model directory.
"""

from __future__ import annotations

import torch

from .. import envs


def current_platform() -> str:
    if envs.DEEPINFER_ACCELERATOR == "nvidia" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"nvidia-sm{major}{minor}"
    return "cpu"


# Relative tolerance per platform for per-sample decode PPL. The CPU path is deterministic, so a run
# on the same CPU type reproduces the baseline bitwise; the slack covers other CPU types, whose BLAS
# may round an FP64 sum differently and move a logit by an FP32 ulp. GPUs: other driver / library
# versions change kernel choices.
TOLERANCES = {"cpu": 1e-3}
DEFAULT_GPU_TOLERANCE = 2e-2


def tolerance(platform: str) -> float:
    return TOLERANCES.get(platform, DEFAULT_GPU_TOLERANCE)
