"""The accelerator devices of this host: ids, names, memory, compute capability, NUMA node.

Sources in order of preference: NVML (exact, no CUDA context), `nvidia-smi --query-gpu`
(same data through the CLI), then sysfs / procfs (names from the driver's /proc files, NUMA node
from the PCI device; memory and compute capability stay unknown). Indices follow NVML /
nvidia-smi order, which is PCI bus order; set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA agrees.
"""

from __future__ import annotations

import csv
import io
import logging
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer_cluster._nvml import as_str, nvml_session
from deepinfer_cluster._text import read_text
from deepinfer_cluster.accelerator import (
    AcceleratorKind,
    accelerator_kind,
    normalize_pci_address,
    nvidia_pci_addresses,
    pci_numa_node,
    physical_device_ids,
)
from deepinfer_cluster.cpu import numa_nodes, numa_nodes_from_sysfs

log = logging.getLogger(__name__)

NVIDIA_SMI_QUERY_FIELDS = "index,name,memory.total,compute_cap,pci.bus_id"


@dataclass(frozen=True)
class DeviceInfo:
    index: int  # physical index (NVML / nvidia-smi / /dev/davinciN numbering)
    kind: AcceleratorKind
    name: str
    memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    pci_address: str | None = None  # sysfs form "0000:18:00.0"
    numa_node: int | None = None
    source: str = "sysfs"  # which probe produced it: "nvml", "nvidia-smi" or "sysfs"

    @property
    def memory_gib(self) -> float | None:
        return None if self.memory_bytes is None else self.memory_bytes / 2**30


def parse_nvidia_smi_query(text: str, root: Path | str = "/") -> list[DeviceInfo]:
    """Parse `nvidia-smi --query-gpu=index,name,memory.total,compute_cap,pci.bus_id
    --format=csv,noheader,nounits`; the NUMA node comes from sysfs under `root`."""
    devices = []
    for row in csv.reader(io.StringIO(text)):
        if not row or not "".join(row).strip():
            continue
        if len(row) != 5:
            raise ValueError(f"nvidia-smi query row {row!r}: expected the 5 fields {NVIDIA_SMI_QUERY_FIELDS}")
        index, name, mem_mib, cap, bus = (f.strip() for f in row)
        pci = normalize_pci_address(bus)
        devices.append(
            DeviceInfo(
                index=int(index),
                kind=AcceleratorKind.NVIDIA,
                name=name,
                memory_bytes=int(float(mem_mib)) * 2**20 if mem_mib not in ("", "[N/A]") else None,
                compute_capability=_parse_capability(cap),
                pci_address=pci,
                numa_node=pci_numa_node(pci, root),
                source="nvidia-smi",
            )
        )
    return sorted(devices, key=lambda d: d.index)


def _parse_capability(text: str) -> tuple[int, int] | None:
    if "." not in text:
        return None  # "[N/A]" on old drivers
    major, minor = text.split(".", 1)
    return int(major), int(minor)


def _probe_nvml(root: Path | str) -> list[DeviceInfo] | None:
    with nvml_session() as nvml:
        if nvml is None:
            return None
        devices = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            pci = normalize_pci_address(as_str(nvml.nvmlDeviceGetPciInfo(h).busId))
            devices.append(
                DeviceInfo(
                    index=i,
                    kind=AcceleratorKind.NVIDIA,
                    name=as_str(nvml.nvmlDeviceGetName(h)),
                    memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                    compute_capability=tuple(nvml.nvmlDeviceGetCudaComputeCapability(h)),
                    pci_address=pci,
                    numa_node=pci_numa_node(pci, root),
                    source="nvml",
                )
            )
        return devices


def _probe_nvidia_smi(root: Path | str) -> list[DeviceInfo] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, f"--query-gpu={NVIDIA_SMI_QUERY_FIELDS}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
        return parse_nvidia_smi_query(out, root)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.info("nvidia-smi query failed (%s); falling back to sysfs", exc)
        return None


def _nvidia_model_name(root: Path, pci: str) -> str:
    """'Model:' line of the driver's /proc/driver/nvidia/gpus/<pci>/information."""
    gpus = root / "proc/driver/nvidia/gpus"
    if gpus.is_dir():
        for entry in gpus.iterdir():
            if normalize_pci_address(entry.name) == pci:
                for line in (read_text(entry / "information") or "").splitlines():
                    key, _, value = line.partition(":")
                    if key.strip() == "Model":
                        return value.strip()
    return "NVIDIA GPU"


def probe_devices_from_sysfs(root: Path | str = "/") -> list[DeviceInfo]:
    """Devices from the filesystem alone: names where the driver publishes them, NUMA nodes."""
    root = Path(root)
    kind = accelerator_kind(root)
    if kind is AcceleratorKind.NVIDIA:
        addrs = nvidia_pci_addresses(root)
        ids = physical_device_ids(kind, root)
        if len(addrs) != len(ids):
            # /dev nodes without PCI data (containers): ids known, placement unknown.
            return [DeviceInfo(i, kind, "NVIDIA GPU") for i in ids]
        return [
            DeviceInfo(
                i, kind, _nvidia_model_name(root, pci), pci_address=pci, numa_node=pci_numa_node(pci, root)
            )
            for i, pci in zip(ids, addrs)
        ]
    if kind is AcceleratorKind.ASCEND:
        return [DeviceInfo(i, kind, "Ascend NPU") for i in physical_device_ids(kind, root)]
    return []


def single_numa_node(root: Path | str = "/") -> int | None:
    """The host's NUMA node when it has exactly one, else None.

    Virtual machines often report numa_node -1 for every PCI device; on a one-node host the
    device's node is still known: it is the only one.
    """
    nodes = numa_nodes_from_sysfs(root)
    if nodes is None and str(root) == "/":
        nodes = numa_nodes()
    return nodes[0].id if nodes is not None and len(nodes) == 1 else None


def probe_devices(root: Path | str = "/") -> list[DeviceInfo]:
    """All accelerator devices of this host (empty on a CPU-only host). NVML, nvidia-smi, sysfs."""
    kind = accelerator_kind(root)
    found: list[DeviceInfo] | None = None
    if kind is AcceleratorKind.NVIDIA and str(root) == "/":
        found = _probe_nvml(root) or _probe_nvidia_smi(root)
    found = found or probe_devices_from_sysfs(root)
    if any(d.numa_node is None for d in found) and (only := single_numa_node(root)) is not None:
        found = [d if d.numa_node is not None else replace(d, numa_node=only) for d in found]
    return found
