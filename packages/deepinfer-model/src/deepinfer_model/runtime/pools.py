"""Paged cache pools: one float32 tensor per (layer, kind), addressed by the scheduler's block ids.

A pool holds `slots_per_block` vectors per block: one per token (SWA keys, compressor inputs) or one
per compressed entry (`block_size / ratio` entries, or 1 when the ratio spans several blocks). Values
are stored as float32; the model rounds every cached value to FP32 or BF16 before storing, so the
round trip is exact.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..numerics import carrier

log = logging.getLogger("deepinfer_model.runtime")

TOKEN_IDS = "token_ids"  # the raw token ids (Engram's n-gram context), one int64 per token


@dataclass(frozen=True)
class PoolSpec:
    name: str  # e.g. "swa.3", "comp.1", "index_k.1", "hidden.1"
    slots_per_block: int
    dim: int
    dtype: torch.dtype = torch.float32
    host: bool = False  # kept in host memory whatever the cache's device (host-only bookkeeping)

    def bytes_per_block(self) -> int:
        return self.slots_per_block * self.dim * self.dtype.itemsize


class PagedKVCache:
    """All pools of one model; `read`/`write` take flat slot indices from `StepMetadata`."""

    def __init__(self, specs: list[PoolSpec], num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        cpu = torch.device("cpu")
        self.specs = {s.name: s for s in specs}
        fill = {torch.float32: float("nan"), torch.int64: -1}
        # NaN / -1 initialisation: a read of a slot never written poisons the logits instead of
        # silently returning zeros.
        self.pools = {
            s.name: torch.full(
                (num_blocks * s.slots_per_block, s.dim),
                fill[s.dtype],
                dtype=s.dtype,
                device=cpu if s.host else self.device,
            )
            for s in specs
        }

    def write(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        pool = self.pools[name]
        if len(slots) == 0:  # e.g. a YOCO chunk wholly before rect_lo stores no consumer SWA key
            return
        pool[slots] = values.to(pool.dtype).reshape(len(slots), -1)

    def read(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """FP64 [len(slots), dim] (token ids: int64)."""
        v = self.pools[name][slots]
        return v if v.dtype == torch.int64 else v.to(carrier())

    def poison(self, block_ids) -> None:
        """Overwrite blocks (e.g. ones the scheduler freed) with NaN / -1: a test build's stale-KV detector."""
        host_ids = torch.as_tensor(list(block_ids), dtype=torch.long, device="cpu")
        for name, pool in self.pools.items():
            per = self.specs[name].slots_per_block
            ids = host_ids.to(pool.device)
            rows = (ids[:, None] * per + torch.arange(per, device=pool.device)[None, :]).reshape(-1)
            pool[rows] = float("nan") if pool.dtype.is_floating_point else -1

    @property
    def bytes_per_block(self) -> int:
        return sum(s.bytes_per_block() for s in self.specs.values())

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools.values())


def available_memory_bytes(device: torch.device | None = None) -> int:
    """Memory available now: free memory of a CUDA `device`, else host memory (psutil when installed,
    else the POSIX page counters)."""
    if device is not None and torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        import psutil
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(psutil.virtual_memory().available)


def blocks_for_budget(
    specs: list[PoolSpec],
    kv_cache_memory_bytes: int | None = None,
    memory_fraction: float = 0.1,
    device: torch.device | None = None,
) -> int:
    """How many blocks fit: `kv_cache_memory_bytes`, or `memory_fraction` of the currently available
    memory of `device` (host memory for the CPU / None). Logs the result (engine.md §4: the number of
    blocks is always reported)."""
    per_block = sum(s.bytes_per_block() for s in specs)
    if kv_cache_memory_bytes is None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        budget = int(available_memory_bytes(device) * memory_fraction)
        source = f"{memory_fraction:.0%} of available memory"
    else:
        if kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {kv_cache_memory_bytes}")
        budget, source = int(kv_cache_memory_bytes), "kv_cache_memory_bytes"
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget {budget} B ({source}) is below one block ({per_block} B): raise it"
        )
    log.info(
        "KV cache: %d blocks x %d B = %.1f MiB (%s, %d pools)",
        num_blocks,
        per_block,
        num_blocks * per_block / 2**20,
        source,
        len(specs),
    )
    return num_blocks
