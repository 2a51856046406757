"""Prove device-awareness without a GPU: a mode in which a forgotten `device=` fails on the CPU.

On a CPU-only machine a tensor factory without `device=` is invisible (everything is CPU); on CUDA its
result lands on the CPU and fails (or silently copies) when it meets the model's tensors. Under
`strict_device()` every factory call (`torch.zeros`, `arange`, `full`, `tensor`, `as_tensor`, ...)
without an explicit device raises, and `torch.from_numpy` (always a host tensor) is disabled: host
metadata must reach the device through `runtime.device.to_device` or a factory given `device=`.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

_FACTORIES = _device_constructors()


class StrictDevice(TorchFunctionMode):
    """Raise on a tensor factory called without an explicit `device=` (a CUDA run would put its result on
    the CPU and fail, or silently copy, when it meets the model's tensors)."""

    def __init__(self, allow: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.allow = tuple(allow)  # module prefixes whose host buffers are host-side by design

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not (self.allow and caller.startswith(self.allow)):
                raise AssertionError(f"torch.{func.__name__} called without device= (in {caller})")
        return func(*args, **kwargs)


def _no_from_numpy(*_args, **_kwargs):
    raise AssertionError("torch.from_numpy makes a host tensor: use runtime.device.to_device")


@contextlib.contextmanager
def strict_device(allow: tuple[str, ...] = ()):
    """`StrictDevice` active and `torch.from_numpy` disabled for the duration of the block. `allow`:
    module-name prefixes exempt from the factory check (code whose buffers live on the host by design,
    e.g. grammar bitmasks filled by the CPU)."""
    real = torch.from_numpy
    torch.from_numpy = _no_from_numpy
    try:
        with StrictDevice(allow):
            yield
    finally:
        torch.from_numpy = real
