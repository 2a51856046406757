"""Which accelerator this host has, found by looking at the filesystem only.

Nothing here imports a runtime (torch, CUDA, CANN), so the launcher and the binding code can ask
before any device context exists (creating one in the launcher would pin memory on device 0 and
break fork-based children).
"""

from __future__ import annotations

import enum
import re
from pathlib import Path

from deepinfer_cluster._text import read_text

NVIDIA_PCI_VENDOR = 0x10DE
HUAWEI_PCI_VENDOR = 0x19E5
# PCI base classes: 0x03 display controllers (GPUs show as 0x0300 VGA or 0x0302 3D),
# 0x12 processing accelerators (Ascend NPUs).
_DISPLAY_CLASS = 0x03
_ACCELERATOR_CLASS = 0x12


class AcceleratorKind(enum.StrEnum):
    NVIDIA = "nvidia"
    ASCEND = "ascend"
    CPU = "cpu"

    @property
    def visible_devices_var(self) -> str | None:
        """The environment variable that narrows which devices a process sees."""
        return {"nvidia": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES"}.get(self.value)


def _numbered(directory: Path, prefix: str) -> list[int]:
    """Ids N of entries named <prefix>N (e.g. /dev/nvidia3), sorted."""
    if not directory.is_dir():
        return []
    pattern = re.compile(re.escape(prefix) + r"(\d+)")
    ids = [int(m.group(1)) for e in directory.iterdir() if (m := pattern.fullmatch(e.name))]
    return sorted(ids)


def pci_devices(
    root: Path | str = "/", vendor: int | None = None, base_class: int | None = None
) -> list[str]:
    """PCI addresses (sysfs form, "0000:18:00.0") filtered by vendor id and base class, sorted."""
    base = Path(root) / "sys/bus/pci/devices"
    if not base.is_dir():
        return []
    found = []
    for dev in base.iterdir():
        ven, cls = read_text(dev / "vendor"), read_text(dev / "class")
        if ven is None or cls is None:
            continue
        if vendor is not None and int(ven, 16) != vendor:
            continue
        if base_class is not None and (int(cls, 16) >> 16) != base_class:
            continue
        found.append(dev.name)
    return sorted(found)


def nvidia_pci_addresses(root: Path | str = "/") -> list[str]:
    """NVIDIA GPUs by PCI address: the driver's /proc list, else the PCI bus (vendor 0x10de, display)."""
    proc = Path(root) / "proc/driver/nvidia/gpus"
    if proc.is_dir():
        addrs = sorted(normalize_pci_address(e.name) for e in proc.iterdir())
        if addrs:
            return addrs
    return pci_devices(root, NVIDIA_PCI_VENDOR, _DISPLAY_CLASS)


def accelerator_kind(root: Path | str = "/") -> AcceleratorKind:
    """Ascend if NPUs are present, else NVIDIA if GPUs are, else CPU (spec §7.6 order)."""
    root = Path(root)
    if (
        _numbered(root / "dev", "davinci")
        or list((root / "sys/class/ubcore").glob("udma*"))
        or pci_devices(root, HUAWEI_PCI_VENDOR, _ACCELERATOR_CLASS)
    ):
        return AcceleratorKind.ASCEND
    if _numbered(root / "dev", "nvidia") or nvidia_pci_addresses(root):
        return AcceleratorKind.NVIDIA
    return AcceleratorKind.CPU


def physical_device_ids(kind: AcceleratorKind | None = None, root: Path | str = "/") -> list[int]:
    """Ids of the physical devices of `kind` (device-node numbers, else 0..count-1 from PCI)."""
    root = Path(root)
    kind = accelerator_kind(root) if kind is None else AcceleratorKind(kind)
    if kind is AcceleratorKind.ASCEND:
        ids = _numbered(root / "dev", "davinci")
        return ids or list(range(len(pci_devices(root, HUAWEI_PCI_VENDOR, _ACCELERATOR_CLASS))))
    if kind is AcceleratorKind.NVIDIA:
        ids = _numbered(root / "dev", "nvidia")
        return ids or list(range(len(nvidia_pci_addresses(root))))
    return []


def normalize_pci_address(address: str) -> str:
    """ "00000000:18:00.0" (nvidia-smi / NVML) or "0000:18:00.0" -> sysfs form "0000:18:00.0"."""
    address = address.strip().lower()
    m = re.fullmatch(r"(?:([0-9a-f]+):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])", address)
    if not m:
        raise ValueError(f"pci address {address!r} is not of the form [domain:]bus:device.function")
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


def pci_numa_node(address: str, root: Path | str = "/") -> int | None:
    """NUMA node of a PCI device from sysfs; None when unknown (the kernel writes -1)."""
    text = read_text(Path(root) / "sys/bus/pci/devices" / normalize_pci_address(address) / "numa_node")
    if text is None:
        return None
    node = int(text.strip())
    return node if node >= 0 else None
