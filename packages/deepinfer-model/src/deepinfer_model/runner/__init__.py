"""Model runners: execute one scheduled step and return the logits the sampler needs."""

from .recompute import RecomputeRunner
from .step import StepBatch

__all__ = ["RecomputeRunner", "StepBatch"]
