"""Prove on the CPU that a step makes no host sync (what a CUDA graph capture would reject).

On a CPU-only machine a device->host read is free and invisible; on CUDA it stalls the host and breaks
graph capture. Under `no_host_sync()` every operation that would need one raises `HostSyncError`:

* scalar reads: `aten._local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`, `if t:`), `.tolist()`,
  `.numpy()`;
* data-dependent output shapes: `nonzero`, `unique`, `masked_select`, boolean-mask indexing
  (`aten.index` / `index_put` with a bool index), `repeat_interleave` with tensor repeats (no
  output size), `bincount` (CUDA reads its max back), `argwhere`;
* tensors made from host data inside the step (`torch.tensor` / `as_tensor` / `from_numpy` of
  non-tensor data: a graph would replay the captured values; step inputs must come from buffers).

`count_ops()` counts the ATen ops a block dispatches and how many of them are such syncs: the host
work of a step (each op is a kernel launch on CUDA).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(AssertionError):
    """An operation that needs a device->host read (or host data) ran under `no_host_sync`."""


_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero_numpy.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}
_INDEX_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_HOST_METHODS = {"tolist", "numpy", "item"}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.asarray}


def _sync_reason(func, args, kwargs) -> str | None:
    if func in _SYNC_OPS:
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
            return None
        return str(func)
    if func in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return f"{func} with a boolean mask (nonzero)"
    return None


class _DispatchCheck(TorchDispatchMode):
    def __init__(self, raise_on_sync: bool) -> None:
        super().__init__()
        self.raise_on_sync = raise_on_sync
        self.ops = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            self.syncs += 1
            if self.raise_on_sync:
                raise HostSyncError(f"host sync in a graph-safe step: {reason}")
        return func(*args, **kwargs)


class _FunctionCheck(TorchFunctionMode):
    def __init__(self, raise_on_sync: bool, counter: _DispatchCheck) -> None:
        super().__init__()
        self.raise_on_sync = raise_on_sync
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reason = None
        if name in _HOST_METHODS and args and isinstance(args[0], torch.Tensor):
            reason = f"Tensor.{name}()"
        elif func in _FROM_DATA and args and not isinstance(args[0], torch.Tensor):
            reason = f"torch.{name} of host data"
        if reason is not None:
            self.counter.syncs += 1
            if self.raise_on_sync:
                raise HostSyncError(f"host sync in a graph-safe step: {reason}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _check(raise_on_sync: bool):
    d = _DispatchCheck(raise_on_sync)
    with _FunctionCheck(raise_on_sync, d), d:
        yield d


def no_host_sync():
    """Raise `HostSyncError` on the first operation that needs a device->host read (see the module)."""
    return _check(True)


def count_ops():
    """Count dispatched ATen ops (`.ops`) and host syncs (`.syncs`) of the block, raising on nothing."""
    return _check(False)
