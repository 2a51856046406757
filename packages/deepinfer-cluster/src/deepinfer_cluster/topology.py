"""Links between the devices of one host, and the questions placement code asks about them.

Built from `nvidia-smi topo -m` text or from NVML. Link kinds follow nvidia-smi's vocabulary,
ordered from closest to farthest so that `min()` / comparisons mean "closer":
NVLINK (a bonded set of NVLinks, directly or through NVSwitch), PIX (at most one PCIe bridge),
PXB (several PCIe bridges), PHB (through a PCIe host bridge), NODE (between host bridges of one
NUMA node), SYS (across the inter-socket interconnect).
"""

from __future__ import annotations

import enum
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer_cluster._nvml import as_str, nvml_session
from deepinfer_cluster._text import parse_cpu_list
from deepinfer_cluster.accelerator import normalize_pci_address, pci_numa_node
from deepinfer_cluster.cpu import numa_nodes


class LinkKind(enum.IntEnum):
    SELF = 0
    NVLINK = 1
    PIX = 2
    PXB = 3
    PHB = 4
    NODE = 5
    SYS = 6
    UNKNOWN = 7

    @property
    def within_numa_node(self) -> bool:
        """Both ends hang off the same NUMA node (only SYS crosses sockets)."""
        return self <= LinkKind.NODE


@dataclass(frozen=True)
class Link:
    kind: LinkKind
    nvlinks: int = 0  # number of bonded NVLinks when kind is NVLINK (0 if not reported)

    def __str__(self) -> str:
        if self.kind is LinkKind.NVLINK:
            return f"NV{self.nvlinks}"
        return "X" if self.kind is LinkKind.SELF else self.kind.name


def parse_link(token: str) -> Link:
    """One cell of `nvidia-smi topo -m` ("X", "NV18", "PIX", "SYS", ...)."""
    token = token.strip().upper()
    if token == "X":
        return Link(LinkKind.SELF)
    if m := re.fullmatch(r"NV(\d+)", token):
        return Link(LinkKind.NVLINK, int(m.group(1)))
    if token == "NVB":  # NVLink path through a bridge GPU
        return Link(LinkKind.NVLINK)
    if token == "SOC":  # older drivers' name for SYS
        return Link(LinkKind.SYS)
    if token in LinkKind.__members__:
        return Link(LinkKind[token])
    return Link(LinkKind.UNKNOWN)


@dataclass
class Topology:
    """Device-to-device links of one host. Devices are physical indices 0..n-1 in NVML order."""

    links: list[list[Link]]
    numa_nodes: list[int | None]  # per device
    cpu_affinity: list[tuple[int, ...]]  # per device (empty when unknown)
    nic_names: list[str] = field(default_factory=list)
    nic_links: list[list[Link]] = field(default_factory=list)  # [device][nic]

    def __post_init__(self) -> None:
        n = len(self.links)
        if any(len(row) != n for row in self.links):
            raise ValueError(f"link matrix must be square, got rows of {[len(r) for r in self.links]}")
        if len(self.numa_nodes) != n or len(self.cpu_affinity) != n:
            raise ValueError("numa_nodes and cpu_affinity need one entry per device")

    @property
    def num_devices(self) -> int:
        return len(self.links)

    def _check(self, *devices: int) -> None:
        for d in devices:
            if not 0 <= d < self.num_devices:
                raise ValueError(f"device {d} out of range [0, {self.num_devices})")

    def link(self, a: int, b: int) -> Link:
        self._check(a, b)
        return self.links[a][b]

    def nvlinked(self, a: int, b: int) -> bool:
        return a != b and self.link(a, b).kind is LinkKind.NVLINK

    def same_numa(self, a: int, b: int) -> bool:
        """True when both devices are attached to the same NUMA node (by sysfs, else by link kind)."""
        self._check(a, b)
        na, nb = self.numa_nodes[a], self.numa_nodes[b]
        if na is not None and nb is not None:
            return na == nb
        return self.link(a, b).kind.within_numa_node and self.link(a, b).kind is not LinkKind.NVLINK

    def nvlink_domains(self) -> list[tuple[int, ...]]:
        """Connected components of the NVLink graph (each device alone when there is no NVLink)."""
        seen: set[int] = set()
        domains = []
        for start in range(self.num_devices):
            if start in seen:
                continue
            comp, stack = set(), [start]
            while stack:
                d = stack.pop()
                if d in comp:
                    continue
                comp.add(d)
                stack.extend(o for o in range(self.num_devices) if self.nvlinked(d, o) and o not in comp)
            seen |= comp
            domains.append(tuple(sorted(comp)))
        return domains

    def nvlink_domain_size(self) -> int:
        """Devices of this host reachable from each other over NVLink (largest domain).

        Multi-node NVLink (GB200 NVL72) spans hosts; this sees only the local part of it.
        """
        return max((len(d) for d in self.nvlink_domains()), default=0)

    def within_nvlink_domain(self, devices: Iterable[int]) -> bool:
        """Whether a group of devices (e.g. one EP or CP group) talks over NVLink only."""
        devices = list(devices)
        self._check(*devices)
        return any(set(devices) <= set(d) for d in self.nvlink_domains())

    def devices_on_numa(self, node: int) -> list[int]:
        return [d for d, n in enumerate(self.numa_nodes) if n == node]

    def nearest_nic(self, device: int) -> str | None:
        """The NIC with the closest link to `device` (for pinning RDMA traffic), None without NICs."""
        self._check(device)
        if not self.nic_names:
            return None
        best = min(range(len(self.nic_names)), key=lambda k: (self.nic_links[device][k].kind, k))
        return self.nic_names[best]

    def matrix_text(self) -> str:
        """The link matrix in nvidia-smi's notation, one row per device."""
        head = "\t" + "\t".join(f"GPU{i}" for i in range(self.num_devices))
        rows = [f"GPU{i}\t" + "\t".join(str(x) for x in row) for i, row in enumerate(self.links)]
        return "\n".join([head, *rows])


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_nvidia_smi_topo(text: str) -> Topology:
    """Parse `nvidia-smi topo -m` output (tab-separated matrix, legend ignored)."""
    lines = [_ANSI.sub("", line).rstrip("\n") for line in text.splitlines()]
    header: list[str] | None = None
    rows: dict[str, list[str]] = {}
    nic_alias: dict[str, str] = {}
    in_legend = False  # after "Legend:" only the NIC aliases ("  NIC0: mlx5_0") matter
    for line in lines:
        cells = [c.strip() for c in line.split("\t")]
        stripped = line.strip()
        if header is None:
            if "GPU0" in cells:
                header = cells if cells[0] == "" else ["", *cells]
            continue
        if stripped.startswith("Legend"):
            in_legend = True
        if m := re.fullmatch(r"(NIC\d+):\s*(\S+)", stripped):
            nic_alias[m.group(1)] = m.group(2)
        elif not in_legend and cells[0] and cells[0] in header:
            rows[cells[0]] = cells
    if header is None:
        raise ValueError("nvidia-smi topo output: no header line naming GPU0")
    gpu_cols = [(i, c) for i, c in enumerate(header) if re.fullmatch(r"GPU\d+", c)]
    gpus = [c for _, c in gpu_cols]
    if not gpus or [int(g[3:]) for g in gpus] != list(range(len(gpus))):
        raise ValueError(f"nvidia-smi topo output: GPU columns {gpus} are not GPU0..GPUn-1")
    nic_cols = [(i, c) for i, c in enumerate(header) if c and c not in gpus and c in rows]
    col = {c: i for i, c in enumerate(header)}

    def cell(row: list[str], name: str) -> str:
        i = col.get(name)
        return row[i] if i is not None and i < len(row) else ""

    links, numa, affinity, nic_links = [], [], [], []
    for g in gpus:
        row = rows.get(g)
        if row is None:
            raise ValueError(f"nvidia-smi topo output: no row for {g}")
        links.append([parse_link(row[i]) for i, _ in gpu_cols])
        nic_links.append([parse_link(row[i]) for i, _ in nic_cols])
        node = cell(row, "NUMA Affinity")
        numa.append(int(node) if node.isdigit() else None)
        cpus = cell(row, "CPU Affinity")
        affinity.append(parse_cpu_list(cpus) if re.fullmatch(r"[\d,\-]+", cpus) else ())
    for a in range(len(gpus)):
        for b in range(len(gpus)):
            if (a == b) != (links[a][b].kind is LinkKind.SELF):
                raise ValueError(
                    f"nvidia-smi topo output: GPU{a}-GPU{b} cell {links[a][b]} breaks the diagonal"
                )
    nic_names = [nic_alias.get(c, c) for _, c in nic_cols]
    return Topology(links, numa, affinity, nic_names, nic_links)


# NVML's common-ancestor levels (nvmlGpuTopologyLevel_t) mapped to nvidia-smi's link names.
_NVML_LEVEL_TO_KIND = {
    0: LinkKind.PIX,
    10: LinkKind.PIX,
    20: LinkKind.PXB,
    30: LinkKind.PHB,
    40: LinkKind.NODE,
    50: LinkKind.SYS,
}


def topology_from_nvml(root: Path | str = "/") -> Topology | None:
    """Topology read through NVML; None when NVML is not available."""
    with nvml_session() as nvml:
        if nvml is None:
            return None
        n = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        pcis = [normalize_pci_address(as_str(nvml.nvmlDeviceGetPciInfo(h).busId)) for h in handles]
        direct = [[0] * n for _ in range(n)]
        to_switch = [0] * n
        max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
        for i, h in enumerate(handles):
            for link in range(max_links):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = normalize_pci_address(
                        as_str(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
                    )
                except nvml.NVMLError:
                    continue  # link not present / not supported on this board
                if remote in pcis:
                    direct[i][pcis.index(remote)] += 1
                else:
                    to_switch[i] += 1  # an NVSwitch: every switch-attached GPU is reachable
        links = []
        for i in range(n):
            row = []
            for j in range(n):
                if i == j:
                    row.append(Link(LinkKind.SELF))
                elif direct[i][j] or (to_switch[i] and to_switch[j]):
                    row.append(Link(LinkKind.NVLINK, direct[i][j] or min(to_switch[i], to_switch[j])))
                else:
                    level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    row.append(Link(_NVML_LEVEL_TO_KIND.get(int(level), LinkKind.UNKNOWN)))
            links.append(row)
    host_nodes = numa_nodes(root)
    nodes = {node.id: node.cpus for node in host_nodes}
    only = host_nodes[0].id if len(host_nodes) == 1 else None  # VMs report -1 per device
    numa = [pci_numa_node(p, root) if pci_numa_node(p, root) is not None else only for p in pcis]
    affinity = [nodes.get(x, ()) if x is not None else () for x in numa]
    return Topology(links, numa, affinity)


def probe_topology() -> Topology | None:
    """This host's GPU topology (NVML, else `nvidia-smi topo -m`); None without NVIDIA GPUs."""
    topo = topology_from_nvml()
    if topo is not None and topo.num_devices:
        return topo
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return parse_nvidia_smi_topo(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def topology_from_links(
    links: Sequence[Sequence[str]], numa_nodes: Sequence[int | None] | None = None
) -> Topology:
    """Build a Topology from nvidia-smi cell strings (handy for describing a planned host)."""
    parsed = [[parse_link(c) for c in row] for row in links]
    n = len(parsed)
    return Topology(parsed, list(numa_nodes) if numa_nodes is not None else [None] * n, [()] * n)
