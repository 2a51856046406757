"""How many KV blocks the engine allocates, and what `gpu_memory_utilization` means.

On CUDA (with `num_kv_blocks` unset) the cache gets what is left of `gpu_memory_utilization` x the
device's total memory once everything already on the device is counted (this engine's weights,
other processes); a step's activations come out of the remaining (1 - utilization) share. It never
takes more blocks than `max_num_seqs` sequences of `max_model_len` tokens can use. On the CPU the
cache holds min(max_num_seqs, 64) full-length sequences and `gpu_memory_utilization` is ignored
(a warning says so once when it is set); `num_kv_blocks` sizes it explicitly on any device.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("deepinfer")

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_warned_cpu = False


def kv_cache_blocks(
    *,
    device: torch.device,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_kv_blocks: int | None,
    gpu_memory_utilization: float,
    bytes_per_block: int | None,
    mem_info: tuple[int, int] | None = None,
) -> int:
    """Blocks for the scheduler and the runner. bytes_per_block: one block of every KV pool (None:
    the runner keeps no paged cache). mem_info: (free, total) bytes of `device` (default: read now)."""
    if num_kv_blocks:
        return num_kv_blocks
    blocks_per_seq = -(-max_model_len // block_size)
    if device.type != "cuda" or not bytes_per_block:
        _warn_ignored_on_cpu(gpu_memory_utilization, device)
        return blocks_per_seq * min(max_num_seqs, 64) + 1
    free, total = mem_info if mem_info is not None else torch.cuda.mem_get_info(device)
    budget = gpu_memory_utilization * total - (total - free)
    blocks = int(budget // bytes_per_block) - 1  # one block stays out for the decode graphs' padding
    if blocks < blocks_per_seq:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves {max(budget, 0) / gib:.2f} GiB for the KV "
            f"cache ({(total - free) / gib:.2f} of {total / gib:.2f} GiB already in use); one sequence of "
            f"max_model_len={max_model_len} needs {blocks_per_seq * bytes_per_block / gib:.3f} GiB: raise "
            f"gpu_memory_utilization, lower max_model_len, or set num_kv_blocks"
        )
    chosen = min(blocks, blocks_per_seq * max_num_seqs) + 1
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB) from gpu_memory_utilization=%s",
        chosen,
        block_size,
        chosen * bytes_per_block / 2**30,
        gpu_memory_utilization,
    )
    return chosen


def _warn_ignored_on_cpu(gpu_memory_utilization: float, device: torch.device) -> None:
    global _warned_cpu
    if gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION and not _warned_cpu:
        _warned_cpu = True
        logger.warning(
            "gpu_memory_utilization=%s is ignored on %s: the KV cache holds min(max_num_seqs, 64) "
            "sequences of max_model_len tokens; set num_kv_blocks to size it",
            gpu_memory_utilization,
            device.type,
        )
