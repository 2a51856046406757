"""Functions `torch.compile` must call rather than trace (`runtime.compiled`: the compiled decode step).

Some host code is wrong or wasteful when traced: process-wide caches of device tensors (traced, Dynamo
skips the cache and rebuilds the tensor in the graph: a host-to-device copy on every step, which a CUDA
graph capture forbids), converted weight copies (traced, every weight would be converted on every step),
and accelerator kernel launchers (TileLang / Triton / FlashMLA host code). Marked functions run as they
are outside a compiled region, and as one opaque call (a graph break) inside one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def outside_compiled_graph(fn: Callable, traced: Callable | None = None) -> Callable:
    """`fn`, called eagerly when a compiled region reaches it (attributes of `fn` are kept); with `traced`
    (a torch version of `fn`), the region traces `traced` instead of calling `fn`."""
    outside = torch.compiler.disable(fn) if traced is None else traced

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return outside(*args, **kwargs)
        return fn(*args, **kwargs)

    return call
