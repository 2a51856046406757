"""Paged runtime: per-layer-kind paged caches and the batched cached runner (drop-in for RecomputeRunner).

What every model shares (pools, step metadata, device placement, CUDA-graph capture, the runner); what
depends on the architecture is asked of the model's family (`deepinfer_model.family`), never imported.

from deepinfer_model.runtime import PagedRunner
runner = PagedRunner(model, num_blocks=256, block_size=16)        # or PagedRunner.from_memory(...)
logits = runner.execute(scheduler_output)                          # same contract as RecomputeRunner
runner = PagedRunner(model, 256, 16, yoco=YocoSettings.from_env(), backtracking=6)  # YOCO truncation:
logits = runner.execute(scheduler_output)   # prompt lengths: the step's own (SchedulerOutput.prompt_lens)
"""

from .block_io import (
    BlockPayload,
    PayloadError,
    PoolLayout,
    cache_layout,
    export_blocks,
    export_request,
    import_blocks,
)
from .cuda_graphs import (
    DecodeGraphRunner,
    DecodeGraphSettings,
    build_context_tiers,
    build_graph_batch_sizes,
    decode_graph_settings,
)
from .draft_graphs import DraftGraphRunner
from .draft_sampling import DraftSampling, StaticDraftSampler
from .metadata import StepMetadata
from .pools import PagedKVCache, PoolSpec, blocks_for_budget
from .runner import RUNNERS, PagedRunner, cache_specs, make_runner
from .static_metadata import StaticDecodeMetadata
from .step_view import StepView

__all__ = [
    "BlockPayload",
    "PayloadError",
    "PoolLayout",
    "cache_layout",
    "export_blocks",
    "export_request",
    "import_blocks",
    "RUNNERS",
    "DecodeGraphRunner",
    "DecodeGraphSettings",
    "DraftGraphRunner",
    "DraftSampling",
    "StaticDraftSampler",
    "StaticDecodeMetadata",
    "build_context_tiers",
    "build_graph_batch_sizes",
    "decode_graph_settings",
    "PagedKVCache",
    "PagedRunner",
    "PoolSpec",
    "StepMetadata",
    "StepView",
    "blocks_for_budget",
    "cache_specs",
    "make_runner",
]
