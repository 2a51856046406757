"""The graph-safe decode step compiled by `torch.compile` before it is captured into CUDA graphs.

A graphed decode step on an H200 is bound by its kernel count, not by bytes: ~1,750 kernels per step on
the medium model, most of them FP32 elementwise ops, casts and small reductions between the GEMMs (each a
few microseconds even when replayed from a graph). Inductor fuses those chains into a few generated
kernels; the GEMMs stay cuBLAS calls and the backend's own kernels (TileLang, Triton, FlashMLA) are called
between the compiled regions. The compiled step is then captured by `DecodeGraphRunner` exactly as the
plain one is: inductor's own CUDA graphs are off (mode "default"), the warm-up run before each capture
compiles, so no compilation happens inside a capture.

Shapes: the sizes that vary between graphs (the rows: the bucket; the block-table width: the context tier)
are marked dynamic before the first compile, so one compile serves every bucket of two rows or more at
every tier, and bucket 1 (a size of 1 is always specialised) compiles once more. Left to Dynamo's automatic
dynamic shapes, the first bucket compiled for its sizes, the second recompiled with the rows symbolic, and
each new tier recompiled both graphs (the table width still static); each compile of the medium model took
46-111 s of inductor's code generation on an H200.

Batch-invariant mode never uses it: generated reductions may split differently per shape, which would
break the bitwise guarantee, so BI steps run the plain static step (`DecodeGraphRunner.forward`).
"""

from __future__ import annotations

import functools

import torch

from .. import numerics
from ..compile_boundary import custom_op_overloads, prepare_for_compile

BACKENDS = ("inductor", "aot_eager", "eager")
# every (bucket, tier) of a deployment may need a guard set of its own before shapes go symbolic
_RECOMPILE_LIMIT = 64


@functools.cache
def compiled_static_forward(static_forward, backend: str):
    """A model family's graph-safe step `static_forward(model, meta, cache)` under
    `torch.compile(backend=...)` (one compiled callable per (step, backend) in a process: its compile caches
    are shared by every runner). `aot_eager` traces without generating kernels (the CPU tests: the traced
    step must equal the plain one bitwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {BACKENDS}, got {backend!r}")
    import torch._dynamo

    prepare_for_compile()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    # inductor's default mode: no CUDA graphs of its own inside ours. The numerics settings are read
    # outside the compiled region (`numerics.pinned`): traced, they are constants its guards check once.
    # emulate_precision_casts: a cast to BF16 inside a fused kernel rounds there, as eagerly (by default
    # inductor may keep the FP32 value for uses within the kernel, dropping the model's rounding points).
    options = {"emulate_precision_casts": True} if backend == "inductor" else None
    compiled = torch.compile(static_forward, backend=backend, options=options)

    @functools.wraps(static_forward)
    def forward(model, meta, cache):
        if backend == "inductor":
            register_inductor_fallbacks()
        # the step's index cache emptied before the region (the step empties it first thing as well): entered
        # with the last step's entries, the region's guard on the empty cache would fail and recompile
        meta.reset()
        mark_graph_sizes_dynamic(meta)
        return compiled(model, meta, cache)

    return numerics.pinned(forward)


def register_inductor_fallbacks() -> None:
    """Each of our custom ops (`compile_boundary.as_custom_op`) registered with inductor as a fallback (a call
    of the op itself) before a compile lowers it. Left to inductor, an op without a lowering is registered
    when its first call is lowered, and torch before 2.15 first formats that call's arguments for an info
    log even when the log is off: each input's IR printed as a tree, which re-prints every shared input. The
    step's custom ops chain through all layers (each layer's trunk feeds two of them), so the text doubles
    per layer: with torch 2.11 the tiny model's compile spent >9 min in that formatting on the CPU and never
    finished within a GPU call's limit. Registered here, with the layout constraint inductor would pick, the
    lowering takes the same fallback without the log."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for op in custom_op_overloads():
        if op not in lowering.lowerings:
            tag = get_layout_constraint_tag(op, with_default=True)
            lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag), warn=False)


def mark_graph_sizes_dynamic(meta) -> None:
    """The rows (bucket) and block-table width (context tier) of a static step's metadata, symbolic in the
    compile that first sees them. `maybe_mark_dynamic`: a size the traced code specialises (a size of 1, or a
    Python value computed from it) stays a guard and recompiles instead of raising."""
    for rows in (meta.input_ids, meta.positions, meta.write_slots, meta.logits_rows, meta.rows_index):
        torch._dynamo.maybe_mark_dynamic(rows, 0)
    torch._dynamo.maybe_mark_dynamic(meta.dev_tables, 0)
    torch._dynamo.maybe_mark_dynamic(meta.dev_tables, 1)
