"""deepinfer-cluster: what hardware this host has, how its devices are linked, where each rank
should run, and the launcher that starts the ranks. No torch, no device runtime is imported."""

from deepinfer_cluster.accelerator import (
    AcceleratorKind,
    accelerator_kind,
    normalize_pci_address,
    pci_numa_node,
    physical_device_ids,
)
from deepinfer_cluster.binding import (
    BindResult,
    bind_device,
    bind_local_rank,
    bind_to_numa_node,
    binding_target,
    cores_for_device,
    get_cpu_affinity,
    libnuma_available,
    memory_nodes,
    set_cpu_affinity,
    set_memory_node,
)
from deepinfer_cluster.cpu import NumaNode, numa_nodes, parse_lscpu_parsable
from deepinfer_cluster.devices import (
    DeviceInfo,
    parse_nvidia_smi_query,
    probe_devices,
    probe_devices_from_sysfs,
)
from deepinfer_cluster.layout import ParallelLayout, RankCoords, check_layout, layout_from_env, resolve_layout
from deepinfer_cluster.peak_rates import PeakRates, known_models, lookup_peak_rates, peak_rates
from deepinfer_cluster.topology import (
    Link,
    LinkKind,
    Topology,
    parse_nvidia_smi_topo,
    probe_topology,
    topology_from_links,
    topology_from_nvml,
)
from deepinfer_cluster.visible import (
    assign_visible_devices,
    devices_for_rank,
    parse_visible_devices,
    visible_devices,
    visible_devices_var,
)

__version__ = "0.1.0"

__all__ = [
    "AcceleratorKind",
    "BindResult",
    "DeviceInfo",
    "Link",
    "LinkKind",
    "NumaNode",
    "ParallelLayout",
    "PeakRates",
    "RankCoords",
    "Topology",
    "accelerator_kind",
    "assign_visible_devices",
    "bind_device",
    "bind_local_rank",
    "binding_target",
    "bind_to_numa_node",
    "check_layout",
    "cores_for_device",
    "devices_for_rank",
    "get_cpu_affinity",
    "known_models",
    "layout_from_env",
    "libnuma_available",
    "lookup_peak_rates",
    "memory_nodes",
    "normalize_pci_address",
    "numa_nodes",
    "parse_lscpu_parsable",
    "parse_nvidia_smi_query",
    "parse_nvidia_smi_topo",
    "parse_visible_devices",
    "pci_numa_node",
    "peak_rates",
    "physical_device_ids",
    "probe_devices",
    "probe_devices_from_sysfs",
    "probe_topology",
    "resolve_layout",
    "set_cpu_affinity",
    "set_memory_node",
    "topology_from_links",
    "topology_from_nvml",
    "visible_devices",
    "visible_devices_var",
]
