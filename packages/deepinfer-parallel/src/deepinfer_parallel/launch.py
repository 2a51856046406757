"""Run a function on N local processes with torch.distributed initialised (tests, small experiments).

Multi-node and production launches go through deepinfer-cluster's torchrun-compatible launcher; this
helper only exists so that tests can start gloo worlds of 2-4 CPU processes. The function is found
again in each child by file path and name, so it may live in a pytest file (which is not importable
by module name under ``--import-mode=importlib``).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from deepinfer_cluster import envs, no_multicast_environment


def _load(path: str, name: str) -> Callable:
    spec = importlib.util.spec_from_file_location(f"_deepinfer_worker_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _child(
    rank: int, world_size: int, init_file: str, backend: str, path: str, name: str, args: tuple
) -> None:
    torch.set_num_threads(1)  # N processes share few cores; oversubscription makes gloo crawl
    if backend == "nccl":  # one GPU per rank, chosen before NCCL's first communicator binds a device
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        _load(path, name)(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable,
    world_size: int,
    *args,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    start_method: str = "fork",
) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` new processes; re-raise a failure.

    ``fn`` must be a module-level function; the processes are killed after ``timeout_s``.
    ``fork`` (default) reuses the parent's imported torch: a spawned child re-imports it, which takes
    seconds per process on a busy machine. The child drops to one intra-op thread before any torch work,
    so OpenMP state inherited through fork is never used. Use ``spawn`` for CUDA. The default can be
    changed with ``DEEPINFER_DIST_START_METHOD`` (e.g. ``spawn`` if a parent's threads make fork unsafe).
    """
    start_method = start_method or envs.get("DEEPINFER_DIST_START_METHOD")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    path, name = fn.__code__.co_filename, fn.__name__
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # NVLink multicast off in every rank (deepinfer_cluster.NO_MULTICAST_ENV)
        with warnings.catch_warnings(), no_multicast_environment():
            # Python warns about fork() in a multi-threaded parent; the child avoids the inherited
            # thread pools (one intra-op thread, gloo/NCCL created after the fork).
            warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks.*")
            ctx = mp.start_processes(
                _child, args=(world_size, init_file, backend, path, name, args), nprocs=world_size,
                join=False, start_method=start_method,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"distributed run of {name} did not finish within {timeout_s} s")
