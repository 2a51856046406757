"""Count the device ops (kernel launches on a GPU) and host syncs of a piece of training code, on any device.

A `TorchDispatchMode` sees every aten op that reaches a kernel, the backward's included; views, empty
allocations and `detach` launch nothing and are not counted. Host syncs are the ops that make the host
wait for the device: scalar reads (`.item()`, `bool()`, `int()`), data-dependent shapes (`nonzero`,
boolean-mask indexing, `masked_select`, `unique`) and device-to-host copies. The step time of a
launch-bound GPU step is about (ops x ~10-20 us + syncs x the queue they drain).
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NO_KERNEL = {
    "empty",
    "empty_strided",
    "empty_like",
    "detach",
    "alias",
    "lift_fresh",
    "resolve_conj",
    "resolve_neg",
}
_SYNCS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2"}
_SYNCS |= {"unique_dim", "unique_consecutive", "is_nonzero", "equal", "repeat_interleave", "nonzero_static"}
_MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _is_sync(name: str, args: tuple) -> bool:
    if name in _SYNCS:
        return True
    if name in _MASK_INDEXED and len(args) > 1 and isinstance(args[1], (list, tuple)):
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1])
    return False


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as c: ...` -> `c.ops` (kernel-launching aten ops), `c.syncs` (host syncs),
    `c.by_op` / `c.by_function` (Counters; `by_function` only with `attribute=True`, slow: one stack
    walk per op, naming the innermost frame in `deepinfer*` code, or 'backward/other')."""

    def __init__(self, attribute: bool = False):
        super().__init__()
        self.attribute = attribute
        self.ops = 0
        self.syncs = 0
        self.by_op: collections.Counter = collections.Counter()
        self.sync_by_op: collections.Counter = collections.Counter()
        self.by_function: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if func.is_view or name in _NO_KERNEL:
            return out
        self.ops += 1
        self.by_op[name] += 1
        sync = _is_sync(name, args)
        if name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor) and args:  # device -> host
            src, dst = (args[1], args[0]) if name == "copy_" else (args[0], out)
            sync = isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
        if sync and name == "_local_scalar_dense" and _in_optimizer():
            sync = False  # AdamW's step counters live on the host (capturable=False), on every device
        if sync:
            self.syncs += 1
            self.sync_by_op[name] += 1
        if self.attribute:
            self.by_function[_innermost_own_frame()] += 1
        return out


def _innermost_own_frame() -> str:
    for frame in reversed(traceback.extract_stack(limit=48)):
        path = frame.filename
        if "deepinfer" in path and not path.endswith("op_count.py"):
            return f"{path.split('/src/')[-1]}:{frame.name}"
    return "backward/other"


def _in_optimizer() -> bool:
    return any("/torch/optim/" in f.filename for f in traceback.extract_stack(limit=12))
