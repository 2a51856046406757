"""Probing against recorded host descriptions: sysfs trees built in tmp dirs, nvidia-smi / lscpu
outputs under data/ (see data/README.md for which are captured and which are written by us)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from deepinfer_cluster import (
    AcceleratorKind,
    accelerator_kind,
    assign_visible_devices,
    devices_for_rank,
    normalize_pci_address,
    numa_nodes,
    parse_lscpu_parsable,
    parse_nvidia_smi_query,
    parse_visible_devices,
    physical_device_ids,
    probe_devices,
    probe_devices_from_sysfs,
    visible_devices,
)
from deepinfer_cluster.cpu import numa_nodes_from_sysfs

DATA = Path(__file__).parent / "data"
HGX_BUSES = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
             "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]  # fmt: skip


def write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def add_two_socket_smt2_cpus(root: Path) -> None:
    """sysfs CPU/NUMA files of the host lscpu_2socket_smt2.txt describes (an independent record)."""
    for cpu in range(16):
        core = cpu % 8
        write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/core_id", f"{core % 4}\n")
        write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", f"{core // 4}\n")
    write(root, "sys/devices/system/node/node0/cpulist", "0-3,8-11\n")
    write(root, "sys/devices/system/node/node1/cpulist", "4-7,12-15\n")


def make_hgx_tree(root: Path) -> Path:
    """8 H200 GPUs (4 per NUMA node), an NVSwitch and a NIC that must not count as GPUs."""
    for i, bus in enumerate(HGX_BUSES):
        write(root, f"dev/nvidia{i}")
        write(
            root,
            f"proc/driver/nvidia/gpus/{bus}/information",
            f"Model: \t\t NVIDIA H200\nIRQ:   42\nBus Location: \t {bus}\n",
        )
        write(root, f"sys/bus/pci/devices/{bus}/vendor", "0x10de\n")
        write(root, f"sys/bus/pci/devices/{bus}/class", "0x030200\n")
        write(root, f"sys/bus/pci/devices/{bus}/numa_node", f"{i // 4}\n")
    for extra in ("dev/nvidiactl", "dev/nvidia-uvm", "dev/nvidia-caps/nvidia-cap1"):
        write(root, extra)
    write(root, "sys/bus/pci/devices/0000:05:00.0/vendor", "0x10de\n")  # NVSwitch: bridge class
    write(root, "sys/bus/pci/devices/0000:05:00.0/class", "0x068000\n")
    write(root, "sys/bus/pci/devices/0000:19:00.0/vendor", "0x15b3\n")  # Mellanox NIC
    write(root, "sys/bus/pci/devices/0000:19:00.0/class", "0x020000\n")
    add_two_socket_smt2_cpus(root)
    return root


def test_accelerator_kind_from_filesystem(tmp_path):
    assert accelerator_kind(tmp_path) is AcceleratorKind.CPU
    assert physical_device_ids(root=tmp_path) == []
    hgx = make_hgx_tree(tmp_path / "hgx")
    assert accelerator_kind(hgx) is AcceleratorKind.NVIDIA
    assert physical_device_ids(root=hgx) == list(range(8))
    # PCI data alone (no /dev nodes, no driver) still finds the GPUs but not the NVSwitch.
    pci_only = tmp_path / "pci"
    for bus in HGX_BUSES[:2]:
        write(pci_only, f"sys/bus/pci/devices/{bus}/vendor", "0x10de\n")
        write(pci_only, f"sys/bus/pci/devices/{bus}/class", "0x030200\n")
    write(pci_only, "sys/bus/pci/devices/0000:05:00.0/vendor", "0x10de\n")
    write(pci_only, "sys/bus/pci/devices/0000:05:00.0/class", "0x068000\n")
    assert accelerator_kind(pci_only) is AcceleratorKind.NVIDIA
    assert physical_device_ids(root=pci_only) == [0, 1]
    npu = tmp_path / "npu"
    for i in (0, 1, 2, 3):
        write(npu, f"dev/davinci{i}")
    write(npu, "dev/davinci_manager")
    assert accelerator_kind(npu) is AcceleratorKind.ASCEND
    assert physical_device_ids(root=npu) == [0, 1, 2, 3]
    assert AcceleratorKind.ASCEND.visible_devices_var == "ASCEND_RT_VISIBLE_DEVICES"
    assert AcceleratorKind.NVIDIA.visible_devices_var == "CUDA_VISIBLE_DEVICES"
    assert AcceleratorKind.CPU.visible_devices_var is None


def test_devices_from_sysfs_tree(tmp_path):
    root = make_hgx_tree(tmp_path)
    devices = probe_devices(root)  # a tree root never runs NVML or nvidia-smi
    assert [d.index for d in devices] == list(range(8))
    assert {d.name for d in devices} == {"NVIDIA H200"}
    assert [d.pci_address for d in devices] == HGX_BUSES
    assert [d.numa_node for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(d.memory_bytes is None and d.compute_capability is None for d in devices)


def test_nvidia_smi_query_with_sysfs_numa(tmp_path):
    root = make_hgx_tree(tmp_path)
    devices = parse_nvidia_smi_query((DATA / "h200x8_query.csv").read_text(), root)
    assert [d.pci_address for d in devices] == HGX_BUSES
    assert [d.numa_node for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    d = devices[5]
    assert (d.index, d.name, d.compute_capability, d.source) == (5, "NVIDIA H200", (9, 0), "nvidia-smi")
    assert d.memory_bytes == 143771 * 2**20
    with pytest.raises(ValueError, match="5 fields"):
        parse_nvidia_smi_query("0, NVIDIA H200, 143771\n", root)


def test_captured_h200x2_host(tmp_path):
    """The real two-GPU VM: its sysfs says numa_node -1, so the one NUMA node is used."""
    with tarfile.open(DATA / "captured_h200x2/tree.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    assert accelerator_kind(tmp_path) is AcceleratorKind.NVIDIA
    from_sysfs = probe_devices_from_sysfs(tmp_path)
    assert [d.numa_node for d in from_sysfs] == [None, None]
    devices = probe_devices(tmp_path)
    assert [(d.index, d.name, d.pci_address, d.numa_node) for d in devices] == [
        (0, "NVIDIA H200", "0000:00:06.0", 0),
        (1, "NVIDIA H200", "0000:00:07.0", 0),
    ]
    smi = parse_nvidia_smi_query((DATA / "captured_h200x2/nvidia_smi_query.csv").read_text(), tmp_path)
    assert [d.pci_address for d in smi] == [d.pci_address for d in devices]
    assert all(d.compute_capability == (9, 0) and d.memory_gib > 140 for d in smi)
    nodes = numa_nodes(tmp_path)
    lscpu = parse_lscpu_parsable((DATA / "captured_h200x2/lscpu_p.txt").read_text())
    assert nodes == lscpu and len(nodes) == 1 and len(nodes[0].physical_cores) == 32


def test_numa_nodes_sysfs_and_lscpu_agree(tmp_path):
    add_two_socket_smt2_cpus(tmp_path)
    from_sysfs = numa_nodes_from_sysfs(tmp_path)
    from_lscpu = parse_lscpu_parsable((DATA / "lscpu_2socket_smt2.txt").read_text())
    assert from_sysfs == from_lscpu
    n0, n1 = from_lscpu
    assert n0.cpus == (0, 1, 2, 3, 8, 9, 10, 11) and n0.physical_cores == (0, 1, 2, 3)
    assert n1.cpus == (4, 5, 6, 7, 12, 13, 14, 15) and n1.physical_cores == (4, 5, 6, 7)
    assert n0.smt == 2
    # lscpu without NUMA support leaves the Node column empty: one node 0.
    flat = parse_lscpu_parsable("# CPU,Core,Socket,Node\n0,0,0,\n1,0,0,\n2,1,0,\n")
    assert [(n.id, n.cpus, n.physical_cores) for n in flat] == [(0, (0, 1, 2), (0, 2))]
    with pytest.raises(ValueError, match="header"):
        parse_lscpu_parsable("0,0,0,0\n")


def test_numa_nodes_of_this_machine_cover_its_cpus():
    nodes = numa_nodes()
    import os

    assert set(os.sched_getaffinity(0)) <= {c for n in nodes for c in n.cpus}
    assert all(set(n.physical_cores) <= set(n.cpus) for n in nodes)


def test_pci_address_forms():
    assert normalize_pci_address("00000000:2A:00.0") == "0000:2a:00.0"
    assert normalize_pci_address("0000:2a:00.1") == "0000:2a:00.1"
    assert normalize_pci_address("2a:00.0") == "0000:2a:00.0"
    with pytest.raises(ValueError, match="pci address"):
        normalize_pci_address("GPU-3f2a")


def test_visible_devices_and_rank_assignment():
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert visible_devices(AcceleratorKind.NVIDIA, env) == [4, 5, 6, 7]
    assert devices_for_rank(1, 2, [4, 5, 6, 7]) == [6, 7]
    assert devices_for_rank(0, 1, [4, 5, 6, 7], offset=3) == [7]
    mine = assign_visible_devices(1, per_rank=1, offset=1, kind="nvidia", env=env)
    assert mine == [6] and env["CUDA_VISIBLE_DEVICES"] == "6"
    npu_env = {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert assign_visible_devices(3, per_rank=2, kind="ascend", env=npu_env) == [6, 7]
    assert npu_env["ASCEND_RT_VISIBLE_DEVICES"] == "6,7"
    with pytest.raises(ValueError, match=r"rank 2 needs devices \[4, 6\) of the 4 visible"):
        devices_for_rank(2, 2, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="per_rank"):
        devices_for_rank(0, 0, [0])
    with pytest.raises(ValueError, match="listed twice"):
        parse_visible_devices("0,0")
    with pytest.raises(ValueError, match="not a device index"):
        parse_visible_devices("GPU-1234", "CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match="no visible-device variable"):
        assign_visible_devices(0, kind="cpu", env={})


def test_importing_the_package_loads_no_device_runtime():
    import subprocess
    import sys

    code = (
        "import sys, deepinfer_cluster, deepinfer_cluster.launch\n"
        "deepinfer_cluster.accelerator_kind(); deepinfer_cluster.numa_nodes()\n"
        "print(sorted(m for m in ('torch', 'pynvml', 'torch_npu') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
