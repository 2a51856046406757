"""The graph-safe decode step compiled by `torch.compile` before it is captured into CUDA graphs.

A graphed decode step on an H200 is bound by its kernel count, not by bytes: ~1,750 kernels per step on
the medium model, most of them FP32 elementwise ops, casts and small reductions between the GEMMs (each a
few microseconds even when replayed from a graph). Inductor fuses those chains into a few generated
kernels; the GEMMs stay cuBLAS calls and the backend's own kernels (TileLang, Triton, FlashMLA) are called
between the compiled regions. The compiled step is then captured by `DecodeGraphRunner` exactly as the
plain one is: inductor's own CUDA graphs are off (mode "default"), the warm-up run before each capture
compiles, so no compilation happens inside a capture.

Shapes: the first bucket compiles for its shapes; the next one recompiles with the varying sizes (rows,
block-table width) symbolic, after which every bucket and context tier reuses that graph.

Batch-invariant mode never uses it: generated reductions may split differently per shape, which would
break the bitwise guarantee, so BI steps run the plain static step (`DecodeGraphRunner.forward`).
"""

from __future__ import annotations

import functools

import torch

from .. import numerics

BACKENDS = ("inductor", "aot_eager", "eager")
# every (bucket, tier) of a deployment may need a guard set of its own before shapes go symbolic
_RECOMPILE_LIMIT = 64


@functools.cache
def compiled_static_forward(backend: str):
    """`v41_static_decode_forward` under `torch.compile(backend=...)` (one compiled callable per backend in
    a process: its compile caches are shared by every runner). `aot_eager` traces without generating
    kernels (the CPU tests: the traced step must equal the plain one bitwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"compile backend must be one of {BACKENDS}, got {backend!r}")
    from ..models.deepseek_v41.paged import v41_static_decode_forward

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    # inductor's default mode: no CUDA graphs of its own inside ours. The numerics settings are read
    # outside the compiled region (`numerics.pinned`): traced, they are constants its guards check once.
    # emulate_precision_casts: a cast to BF16 inside a fused kernel rounds there, as eagerly (by default
    # inductor may keep the FP32 value for uses within the kernel, dropping the model's rounding points).
    options = {"emulate_precision_casts": True} if backend == "inductor" else None
    compiled = torch.compile(v41_static_decode_forward, backend=backend, options=options)

    @functools.wraps(v41_static_decode_forward)
    def forward(model, meta, cache):
        # the step's index cache emptied before the region (the step empties it first thing as well): entered
        # with the last step's entries, the region's guard on the empty cache would fail and recompile
        meta.reset()
        return compiled(model, meta, cache)

    return numerics.pinned(forward)
