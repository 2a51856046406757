"""The mode's switch: `DEEPINFER_BATCH_INVARIANT` read through `deepinfer_cluster.envs`, the value pinned for
the model step that is running (`numerics.resolved` sets `_PINNED`), and `sync_free()`, within which the CPU
row paths take no value-dependent branch (the graph-safe decode step)."""

from __future__ import annotations

import contextlib

from deepinfer_cluster import envs

from ..step_pin import StepPin

ENV = "DEEPINFER_BATCH_INVARIANT"

# `.value`: the setting for the model step this thread runs (`numerics.resolved`), None outside one.
_PINNED = StepPin()
# Within `sync_free()` (the graph-safe decode step): the CPU row paths take no data-dependent branch
# (no host read), computing both sides where the eager step picks one from the values.
_SYNC_FREE = False


@contextlib.contextmanager
def sync_free():
    """Within the block, the CPU row paths (`row_gemm`, `exact_gemm`, `grouped_gemm`) make no host read:
    where the eager path tests the values to skip work (rows with more than FP32's bits, lo parts that are
    zero), they compute every candidate and pick per row with `torch.where`, which gives each row the bits
    of the branch the eager path takes (each row's result depends on that row only). The graph-safe decode
    step runs in it (`no_host_sync` proves it on the CPU)."""
    global _SYNC_FREE
    outer, _SYNC_FREE = _SYNC_FREE, True
    try:
        yield
    finally:
        _SYNC_FREE = outer


def enabled() -> bool:
    """Whether the mode is on: within a model step (`numerics.resolved`, which the paged runner enters
    once per step) the value read at its start, otherwise read from the environment at every call, so
    tests and benchmarks may flip it between steps."""
    pinned = _PINNED.value
    return read_env() if pinned is None else pinned


def read_env() -> bool:
    """`DEEPINFER_BATCH_INVARIANT` as set now (a boolean of `deepinfer_cluster.envs`; unset: off)."""
    return envs.get(ENV)
