"""Pin a process to the cores and memory of one NUMA node (its device's node).

CPU affinity through os.sched_setaffinity (psutil where the os call is missing); memory through
libnuma's membind (MPOL_BIND) loaded with ctypes when the library is installed. Both are
inherited across fork and exec, so the launcher can bind a child before it runs its command.
Where binding cannot apply (no NUMA information, no device on a known node, unsupported OS) the
functions log one line and change nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import psutil

from deepinfer_cluster.cpu import NumaNode, numa_nodes
from deepinfer_cluster.devices import DeviceInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BindResult:
    cpus: tuple[int, ...]  # affinity after the call (unchanged when not applied)
    numa_node: int | None
    memory_bound: bool
    applied: bool
    reason: str = ""  # why nothing (or only part) was applied


def get_cpu_affinity(pid: int = 0) -> tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(pid)))
    return tuple(sorted(psutil.Process(pid or os.getpid()).cpu_affinity()))


def set_cpu_affinity(cpus: Sequence[int], pid: int = 0) -> bool:
    """Restrict `pid` (0: this process) to `cpus`. False (and a log line) where unsupported."""
    cpus = sorted(set(cpus))
    if not cpus:
        raise ValueError("cpus: need at least one CPU id")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, cpus)
        return True
    proc = psutil.Process(pid or os.getpid())
    if hasattr(proc, "cpu_affinity"):
        proc.cpu_affinity(cpus)
        return True
    log.info("cpu affinity is not supported on this platform; not pinning to %s", cpus)
    return False


@cache
def _libnuma():
    path = ctypes.util.find_library("numa")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, use_errno=True)
    except OSError:
        return None
    if lib.numa_available() < 0:
        return None  # kernel without NUMA support
    lib.numa_allocate_nodemask.restype = ctypes.c_void_p
    lib.numa_get_membind.restype = ctypes.c_void_p
    lib.numa_bitmask_setbit.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.numa_bitmask_setbit.restype = ctypes.c_void_p
    lib.numa_bitmask_isbitset.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.numa_set_membind.argtypes = [ctypes.c_void_p]
    lib.numa_bitmask_free.argtypes = [ctypes.c_void_p]
    return lib


def libnuma_available() -> bool:
    return _libnuma() is not None


def set_memory_node(node: int) -> bool:
    """Bind this process's future allocations to NUMA node `node` (MPOL_BIND). False without libnuma."""
    lib = _libnuma()
    if lib is None:
        log.info("libnuma not available; memory of this process is not bound to node %d", node)
        return False
    if not 0 <= node <= lib.numa_max_node():
        raise ValueError(f"numa node {node} out of range [0, {lib.numa_max_node()}]")
    mask = lib.numa_allocate_nodemask()
    try:
        lib.numa_bitmask_setbit(mask, node)
        lib.numa_set_membind(mask)
    finally:
        lib.numa_bitmask_free(mask)
    return True


def memory_nodes() -> list[int] | None:
    """Nodes this process may allocate from (libnuma's membind), None without libnuma."""
    lib = _libnuma()
    if lib is None:
        return None
    mask = lib.numa_get_membind()
    try:
        return [n for n in range(lib.numa_max_node() + 1) if lib.numa_bitmask_isbitset(mask, n)]
    finally:
        lib.numa_bitmask_free(mask)


def bind_to_numa_node(
    node: int, cpus: Sequence[int] | None = None, nodes: Sequence[NumaNode] | None = None, memory: bool = True
) -> BindResult:
    """Pin this process to `cpus` (default: all CPUs of `node`) and, if `memory`, its memory to `node`."""
    nodes = numa_nodes() if nodes is None else nodes
    by_id = {n.id: n for n in nodes}
    if node not in by_id:
        raise ValueError(f"numa node {node} not on this host (nodes {sorted(by_id)})")
    target = tuple(cpus) if cpus is not None else by_id[node].cpus
    if not target:
        msg = f"numa node {node} has no CPUs (memory-only node); affinity left unchanged"
        log.info(msg)
        return BindResult(get_cpu_affinity(), node, False, False, msg)
    pinned = set_cpu_affinity(target)
    bound = set_memory_node(node) if memory else False
    reason = "" if bound or not memory else "libnuma unavailable: memory not bound"
    return BindResult(get_cpu_affinity(), node, bound, pinned, reason)


def _share(cores: tuple[int, ...], members: int, position: int) -> tuple[int, ...]:
    """The position-th of `members` equal, disjoint slices of `cores` (all of them if too few)."""
    share = len(cores) // members
    if share == 0:
        return cores  # more members than cores: they share the node
    return cores[position * share : (position + 1) * share]


def cores_for_device(
    device: DeviceInfo, devices: Sequence[DeviceInfo], nodes: Sequence[NumaNode]
) -> tuple[int, ...]:
    """This device's share of its node: the node's physical cores (one logical CPU each) split
    evenly between the devices on that node, in device order (spec §7.6: phys_cores / num_gpus)."""
    if device.numa_node is None:
        raise ValueError(f"device {device.index} has no known NUMA node")
    node = next((n for n in nodes if n.id == device.numa_node), None)
    if node is None:
        raise ValueError(
            f"device {device.index}: numa node {device.numa_node} not among {[n.id for n in nodes]}"
        )
    peers = sorted(d.index for d in devices if d.numa_node == device.numa_node)
    return _share(node.physical_cores, len(peers), peers.index(device.index))


def binding_target(
    local_rank: int,
    local_world_size: int,
    devices: Sequence[DeviceInfo],
    nodes: Sequence[NumaNode],
    device: int | None = None,
) -> tuple[int, tuple[int, ...]] | None:
    """(NUMA node, cores) where a local rank should run, or None (logged) when unknown.

    With accelerators: the node of physical device `device` and that device's core slice.
    Without (CPU ranks): ranks fill the NUMA nodes in contiguous blocks and split each node's
    physical cores evenly.
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank={local_rank} out of range [0, {local_world_size})")
    if devices:
        info = next((d for d in devices if d.index == device), None)
        if info is None or info.numa_node is None:
            log.info("local rank %d: device %s has no known NUMA node; not binding", local_rank, device)
            return None
        return info.numa_node, cores_for_device(info, devices, nodes)
    if not nodes:
        log.info("local rank %d: no NUMA information; not binding", local_rank)
        return None
    node_of = [nodes[r * len(nodes) // local_world_size] for r in range(local_world_size)]
    peers = [r for r in range(local_world_size) if node_of[r] is node_of[local_rank]]
    node = node_of[local_rank]
    return node.id, _share(node.physical_cores, len(peers), peers.index(local_rank))


def bind_local_rank(
    device: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    memory: bool = True,
) -> BindResult:
    """Bind the calling rank (LOCAL_RANK / LOCAL_WORLD_SIZE from the environment by default) to
    the cores and memory of its device's NUMA node. `device` is the physical device id (e.g.
    `visible_devices()[torch.cuda.current_device()]`); leave it None for CPU ranks."""
    from deepinfer_cluster.devices import probe_devices

    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = numa_nodes()
    target = binding_target(local_rank, local_world_size, probe_devices(), nodes, device)
    if target is None:
        return BindResult(get_cpu_affinity(), None, False, False, "no NUMA placement known; not binding")
    return bind_to_numa_node(target[0], target[1], nodes, memory)


def bind_device(
    device: DeviceInfo,
    devices: Sequence[DeviceInfo],
    nodes: Sequence[NumaNode] | None = None,
    slice_cores: bool = True,
    memory: bool = True,
) -> BindResult:
    """Bind this process to `device`'s NUMA node (its slice of cores when `slice_cores`).

    A no-op with a log line when the device's node is unknown (CPU-only host, VM without NUMA data).
    """
    if device.numa_node is None:
        msg = f"device {device.index} ({device.name}) has no known NUMA node; not binding"
        log.info(msg)
        return BindResult(get_cpu_affinity(), None, False, False, msg)
    nodes = numa_nodes() if nodes is None else nodes
    cpus = cores_for_device(device, devices, nodes) if slice_cores else None
    return bind_to_numa_node(device.numa_node, cpus, nodes, memory)
