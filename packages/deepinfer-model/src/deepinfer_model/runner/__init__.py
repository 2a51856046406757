"""Model runners: execute one scheduled step and return the logits the sampler needs."""

from .batch import RunnerBatch
from .recompute import RecomputeRunner

__all__ = ["RecomputeRunner", "RunnerBatch"]
