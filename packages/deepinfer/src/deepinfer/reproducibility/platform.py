"""Which platform key a baseline belongs to: `cpu`, or `nvidia-sm<major><minor>` (e.g. `nvidia-sm90`).

The key follows the device the model runs on (not `DEEPINFER_ACCELERATOR`, which only records the build):
an engine on CUDA is `nvidia-sm<cc>` from `torch.cuda.get_device_capability`, one on the CPU is `cpu`.
Numerics differ between platforms (kernels, reduction orders), never between runs on one platform, so
baselines are keyed by platform rather than by machine or model directory.
"""

from __future__ import annotations

import torch

from .. import envs


def _device_of(where) -> torch.device:
    """`where`: None (where `LLM()` would run: $DEEPINFER_DEVICE, else auto), a device or its name,
    an `LLM` / `LLMEngine` (the device of its model's weights)."""
    from deepinfer_model import model_device, resolve_device

    engine = getattr(where, "engine", where)
    if getattr(engine, "model", None) is not None:
        return model_device(engine.model)
    if where is None:
        return resolve_device(envs.DEEPINFER_DEVICE, "DEEPINFER_DEVICE")
    return resolve_device(where, "device")


def current_platform(where=None) -> str:
    """Platform key of a run on `where` (see `_device_of`): `nvidia-sm<cc>` on CUDA, else `cpu`."""
    dev = _device_of(where)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"nvidia-sm{major}{minor}"
    if dev.type != "cpu":
        raise ValueError(f"no baseline platform for device {dev} (cpu and cuda devices have one)")
    return "cpu"


# Relative tolerance per platform for per-sample decode PPL. The CPU path is deterministic, so a run
# on the same CPU type reproduces the baseline bitwise; the slack covers other CPU types, whose BLAS
# may round an FP64 sum differently and move a logit by an FP32 ulp. GPUs: the same GPU type and
# software stack reproduce a batch-invariant run bitwise too; other driver / cuBLAS / kernel versions
# change kernel choices and reduction orders (BF16 activations on the real model make that worth a few
# 1e-3 of PPL). Unknown GPU generations get the loosest value until they have a measured one.
TOLERANCES = {"cpu": 1e-3, "nvidia-sm90": 5e-3}
DEFAULT_GPU_TOLERANCE = 2e-2


def tolerance(platform: str) -> float:
    return TOLERANCES.get(platform, DEFAULT_GPU_TOLERANCE)
