"""CPU cores per NUMA node: sysfs first, `lscpu -p` when sysfs has no node directories.

A NUMA node lists every logical CPU it owns; `physical_cores` keeps one logical CPU per physical
core (the lowest-numbered SMT sibling), which is what the engine splits between the devices of a
node (spec §7.6: `phys_cores / num_gpus` cores per GPU).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepinfer_cluster._text import parse_cpu_list, read_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]  # every logical CPU of the node
    physical_cores: tuple[int, ...]  # one logical CPU per physical core

    @property
    def smt(self) -> int:
        """Hardware threads per core (1 without SMT)."""
        return max(1, len(self.cpus) // max(1, len(self.physical_cores)))


def _core_keys_from_sysfs(root: Path, cpus: Sequence[int]) -> dict[int, tuple[int, int]]:
    keys: dict[int, tuple[int, int]] = {}
    for cpu in cpus:
        topo = root / "sys/devices/system/cpu" / f"cpu{cpu}" / "topology"
        core, package = read_text(topo / "core_id"), read_text(topo / "physical_package_id")
        # Without topology files every logical CPU counts as its own core.
        keys[cpu] = (int(package), int(core)) if core and package else (-1, cpu)
    return keys


def _first_of_each_core(cpus: Sequence[int], keys: dict[int, tuple[int, int]]) -> tuple[int, ...]:
    seen: dict[tuple[int, int], int] = {}
    for cpu in sorted(cpus):
        seen.setdefault(keys[cpu], cpu)
    return tuple(sorted(seen.values()))


def numa_nodes_from_sysfs(root: Path | str = "/") -> list[NumaNode] | None:
    """Nodes under <root>/sys/devices/system/node, or None when that tree is absent."""
    base = Path(root) / "sys/devices/system/node"
    if not base.is_dir():
        return None
    nodes = []
    for entry in sorted(base.iterdir(), key=lambda p: p.name):
        m = re.fullmatch(r"node(\d+)", entry.name)
        if not m:
            continue
        text = read_text(entry / "cpulist")
        cpus = parse_cpu_list(text) if text else ()
        keys = _core_keys_from_sysfs(Path(root), cpus)
        nodes.append(NumaNode(int(m.group(1)), cpus, _first_of_each_core(cpus, keys)))
    nodes.sort(key=lambda n: n.id)
    return nodes or None


def parse_lscpu_parsable(text: str) -> list[NumaNode]:
    """Parse `lscpu -p[=CPU,Core,Socket,Node]` output (column order read from its header)."""
    columns: list[str] | None = None
    per_node: dict[int, list[tuple[int, tuple[int, int]]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            head = line.lstrip("#").strip()
            if head.upper().startswith("CPU"):
                columns = [c.strip().upper() for c in head.split(",")]
            continue
        if columns is None:
            raise ValueError("lscpu output: no '# CPU,Core,...' header line before the data")
        fields = [f.strip() for f in line.split(",")]
        row = dict(zip(columns, fields))
        cpu = int(row["CPU"])
        core = int(row["CORE"]) if row.get("CORE") else cpu
        socket = int(row["SOCKET"]) if row.get("SOCKET") else 0
        node = int(row["NODE"]) if row.get("NODE") else 0  # empty without NUMA support
        per_node.setdefault(node, []).append((cpu, (socket, core)))
    nodes = []
    for node_id in sorted(per_node):
        entries = per_node[node_id]
        cpus = tuple(sorted(c for c, _ in entries))
        keys = dict(entries)
        nodes.append(NumaNode(node_id, cpus, _first_of_each_core(cpus, keys)))
    return nodes


def numa_nodes(root: Path | str = "/") -> list[NumaNode]:
    """CPU cores per NUMA node of this host (sysfs, then lscpu, then one node of all CPUs)."""
    nodes = numa_nodes_from_sysfs(root)
    if nodes is not None:
        return nodes
    if str(root) == "/" and shutil.which("lscpu"):
        try:
            out = subprocess.run(
                ["lscpu", "-p=CPU,Core,Socket,Node"], capture_output=True, text=True, timeout=10, check=True
            ).stdout
            nodes = parse_lscpu_parsable(out)
            if nodes:
                return nodes
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            log.info("lscpu could not be parsed (%s); treating the host as one NUMA node", exc)
    cpus = (
        tuple(sorted(os.sched_getaffinity(0)))
        if hasattr(os, "sched_getaffinity")
        else tuple(range(os.cpu_count() or 1))
    )
    return [NumaNode(0, cpus, cpus)]


def numa_node_of_cpu(cpu: int, nodes: Sequence[NumaNode]) -> int | None:
    for node in nodes:
        if cpu in node.cpus:
            return node.id
    return None
