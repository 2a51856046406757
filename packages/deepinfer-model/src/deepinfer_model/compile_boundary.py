"""Functions `torch.compile` must call rather than trace (`runtime.compiled`: the compiled decode step).

Some host code is wrong or wasteful when traced: process-wide caches of device tensors (traced, Dynamo
skips the cache and rebuilds the tensor in the graph: a host-to-device copy on every step, which a CUDA
graph capture forbids), converted weight copies (traced, every weight would be converted on every step),
and accelerator kernel launchers (TileLang / Triton / FlashMLA host code). Marked functions run as they
are outside a compiled region, and as one opaque call (a graph break) inside one.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from deepinfer_cluster import envs


def outside_compiled_graph(fn: Callable, traced: Callable | None = None) -> Callable:
    """`fn`, called eagerly when a compiled region reaches it (attributes of `fn` are kept); with `traced`
    (a torch version of `fn`), the region traces `traced` instead of calling `fn`.

    `torch.compiler.disable` imports Dynamo (seconds), which a process that compiles nothing never needs:
    the disabled copy of `fn` is made at once only where Dynamo is loaded already, else by
    `prepare_for_compile` (which `runtime.compiled` calls before it compiles). A region traced before that
    makes the copy itself, at the cost of one more graph break in its first trace."""
    outside = [traced]
    if traced is None:
        if "torch._dynamo" in sys.modules:
            outside[0] = torch.compiler.disable(fn)
        else:
            _NOT_DISABLED.append((fn, outside))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            if outside[0] is None:
                outside[0] = torch.compiler.disable(fn)
            return outside[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call


# (fn, the cell of its disabled copy) for each `outside_compiled_graph(fn)` made while Dynamo was not loaded
_NOT_DISABLED: list[tuple[Callable, list]] = []


def prepare_for_compile() -> None:
    """Make the disabled copy of every function `outside_compiled_graph` has marked so far (imports Dynamo):
    called before `torch.compile`, so that a traced region finds each one ready."""
    while _NOT_DISABLED:
        fn, outside = _NOT_DISABLED.pop()
        if outside[0] is None:
            outside[0] = torch.compiler.disable(fn)


# DEEPINFER_COMPILE_CUSTOM_OPS=0: the functions given to `as_custom_op` stay graph breaks (the earlier behaviour,
# for comparison); read once, when the first op is wrapped
_CUSTOM_OPS_ENV = "DEEPINFER_COMPILE_CUSTOM_OPS"
_CUSTOM_OPS: dict[str, list] = {}  # qualified name -> [the function the op calls now]


def custom_ops_enabled() -> bool:
    return envs.get(_CUSTOM_OPS_ENV)


def as_custom_op(qualname: str, fn: Callable, schema: str, fake: Callable) -> Callable:
    """`fn` as the `torch.library` custom op `qualname` ("deepinfer::name") with `schema`, whose shapes and
    dtypes a compiled region takes from `fake` (same arguments; returns empty tensors of the real outputs'
    shapes and dtypes, contiguous). Given as `outside_compiled_graph(fn, traced=...)`, a compiled region
    records one call of the op instead of breaking its graph: the casts and elementwise ops on either side of
    the call fuse with their neighbours (at a graph break each segment starts and ends with kernels of its own).

    The op runs `fn` with its outputs made contiguous and never aliasing an input (what a custom op
    promises); a later call with the same `qualname` (a rebuilt op table) points the op at the new `fn`.
    Arguments the schema marks as written (`Tensor(a!) x`) are the op's `mutates_args`; such an op returns
    `()` (None): its result is the mutated argument."""
    entry = _CUSTOM_OPS.get(qualname)
    if entry is not None:
        entry[0] = fn
        return entry[1]
    entry = [fn, None]

    def impl(*args, **kwargs):
        out = entry[0](*args, **kwargs)
        if out is None:
            return None
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        return tuple(_fresh(o, inputs) for o in out) if isinstance(out, tuple) else _fresh(out, inputs)

    op = torch.library.custom_op(qualname, impl, mutates_args=_written_args(schema), schema=schema)
    op.register_fake(fake)
    entry[1] = op
    _CUSTOM_OPS[qualname] = entry
    return op


def custom_op_overloads() -> list:
    """The `OpOverload` of every op `as_custom_op` has made so far (what a compiled graph's nodes call)."""
    ops = []
    for qualname in _CUSTOM_OPS:
        namespace, name = qualname.split("::")
        ops.append(getattr(getattr(torch.ops, namespace), name).default)
    return ops


def _written_args(schema: str) -> tuple[str, ...]:
    """The arguments `schema` ("(Tensor(a!) x, ...) -> ...") marks as written."""
    parsed = torch._C.parse_schema(f"deepinfer::schema{schema}")
    return tuple(a.name for a in parsed.arguments if a.alias_info is not None and a.alias_info.is_write)


def _fresh(out: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """`out`, contiguous and in storage of its own (a copy where it is a view of an input)."""
    if not out.is_contiguous():
        return out.contiguous()
    ptr = out.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == ptr for t in inputs):
        return out.clone()
    return out
