"""deepinfer-cluster: what hardware this host has, how its devices are linked, where each rank
should run, the launcher that starts the ranks, and the registry of every DEEPINFER_* environment
variable (`deepinfer_cluster.envs`). No torch, no device runtime is imported.

The names below are imported from their modules on first use, so that reading a setting
(`deepinfer_cluster.envs`) does not load the hardware probes (psutil, ctypes). Other packages import
these names from here, and two modules directly: `envs` and `launch` (the `deepinfer-launch` command).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__public_modules__ = ("envs", "launch")

# module -> the public names it defines
_MODULES: dict[str, tuple[str, ...]] = {
    "accelerator": (
        "AcceleratorKind",
        "accelerator_kind",
        "normalize_pci_address",
        "pci_numa_node",
        "physical_device_ids",
    ),
    "binding": (
        "BindResult",
        "bind_device",
        "bind_local_rank",
        "bind_to_numa_node",
        "binding_target",
        "cores_for_device",
        "get_cpu_affinity",
        "libnuma_available",
        "memory_nodes",
        "set_cpu_affinity",
        "set_memory_node",
    ),
    "cpu": (
        "NumaNode",
        "numa_nodes",
        "parse_lscpu_parsable",
    ),
    "devices": (
        "DeviceInfo",
        "parse_nvidia_smi_query",
        "probe_devices",
        "probe_devices_from_sysfs",
    ),
    "lazy": ("lazy_exports",),
    "layout": (
        "LaunchedRank",
        "ParallelLayout",
        "RankCoords",
        "check_layout",
        "derive_layout",
        "launched_rank",
        "layout_from_env",
        "resolve_layout",
    ),
    "multicast": (
        "NO_MULTICAST_ENV",
        "no_multicast_environment",
    ),
    "peak_rates": (
        "PeakRates",
        "known_models",
        "lookup_peak_rates",
        "peak_rates",
    ),
    "topology": (
        "Link",
        "LinkKind",
        "Topology",
        "parse_nvidia_smi_topo",
        "probe_topology",
        "topology_from_links",
        "topology_from_nvml",
    ),
    "visible": (
        "assign_visible_devices",
        "devices_for_rank",
        "parse_visible_devices",
        "visible_devices",
        "visible_devices_var",
    ),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer_cluster' has no attribute {name!r}")
    loaded = importlib.import_module(f"deepinfer_cluster.{module}")
    # all of the module's names at once: importing it bound the package attribute of its own name (e.g.
    # `peak_rates`) to the module, where the function of that name belongs
    for public in _MODULES[module]:
        globals()[public] = getattr(loaded, public)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
