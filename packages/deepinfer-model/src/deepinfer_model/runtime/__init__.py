"""Paged runtime: per-layer-kind paged caches and the batched cached runner (drop-in for RecomputeRunner).

from deepinfer_model.runtime import PagedRunner
runner = PagedRunner(model, num_blocks=256, block_size=16)        # or PagedRunner.from_memory(...)
logits = runner.execute(scheduler_output)                          # same contract as RecomputeRunner
"""

from .metadata import StepMetadata
from .pools import PagedKVCache, PoolSpec, blocks_for_budget
from .runner import RUNNERS, PagedRunner, cache_specs, make_runner

__all__ = [
    "RUNNERS",
    "PagedKVCache",
    "PagedRunner",
    "PoolSpec",
    "StepMetadata",
    "blocks_for_budget",
    "cache_specs",
    "make_runner",
]
