"""Which device the model runs on, and the one way host-side step metadata reaches it.

The model follows its weights: every tensor the forward allocates takes `device=` from an input or a
weight, so the same code runs on the CPU reference and on CUDA. Host metadata (numpy, built per step
by `StepMetadata` and the group gathers) is copied once per tensor with `to_device`: on CUDA through
pinned memory with `non_blocking=True`, so the copies queue behind the running kernels instead of
stalling the host; on the CPU it is a zero-copy view.
"""

from __future__ import annotations

import numpy as np
import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(device: str | torch.device | None, field: str = "device") -> torch.device:
    """`auto`/None -> cuda if available else cpu; `cpu`, `cuda`, `cuda:N` checked against the machine.

    Raises ValueError naming `field` and the allowed values for anything else, and for a CUDA device
    this machine does not have.
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device.strip().lower() if isinstance(device, str) else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{field} must be one of {DEVICE_CHOICES}, got {device!r}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"{field} must be one of {DEVICE_CHOICES}, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{field} = {device!r} but CUDA is not available on this machine "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use {field} = cpu or auto"
        )
    index = 0 if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"{field} = {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"indices 0..{torch.cuda.device_count() - 1}"
        )
    return torch.device("cuda", index)


def to_device(array, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array (numpy or list) as a tensor on `device`: a zero-copy view on the CPU; on CUDA a
    pinned staging copy sent with `non_blocking=True` (the caching host allocator keeps the staging
    buffer alive until the copy has run, so the numpy array may be reused at once)."""
    arr = np.ascontiguousarray(array)
    host = torch.as_tensor(arr, dtype=dtype, device="cpu")
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def model_device(model) -> torch.device:
    """The device of a model's weights: its `device` (every model family has one), or that of the model a
    wrapper holds as `model` (a recompute wrapper)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    inner = getattr(model, "model", None)
    if inner is not None and inner is not model:
        return model_device(inner)
    return torch.device("cpu")
