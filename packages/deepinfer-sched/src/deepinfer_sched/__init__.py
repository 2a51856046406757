"""DeepInfer's scheduler: sequences, the paged KV block manager and the continuous-batching
scheduler. The core is C++17 (``native/sched``) bound with pybind11; this package adds types."""

from deepinfer_sched._core import (
    BlockAllocator,
    EngineType,
    SchedulerOutput,
    SequenceStatus,
    monotonic_seconds,
)
from deepinfer_sched._core import build_info as _native_build_info
from deepinfer_sched.config import SchedulerConfig
from deepinfer_sched.scheduler import FinishedSequence, ScheduledSeq, Scheduler

__version__ = "0.1.0"


def build_info() -> dict:
    """What the native core was built for: ``{"accelerator": "cpu" | "nvidia", ...}``."""
    return dict(_native_build_info())


__all__ = [
    "BlockAllocator",
    "EngineType",
    "FinishedSequence",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SequenceStatus",
    "build_info",
    "monotonic_seconds",
    "__version__",
]
