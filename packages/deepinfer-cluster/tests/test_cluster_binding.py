"""Binding a process to NUMA cores and memory, on this machine (in child processes, so the test
runner itself stays unpinned)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from deepinfer_cluster import (
    AcceleratorKind,
    DeviceInfo,
    NumaNode,
    bind_device,
    binding_target,
    cores_for_device,
    get_cpu_affinity,
    libnuma_available,
    numa_nodes,
)


def run_child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bind_to_numa_node_on_this_machine():
    node = numa_nodes()[0]
    target = sorted(os.sched_getaffinity(0) & set(node.cpus))[:1]
    res = run_child(
        "import json, os; from deepinfer_cluster import bind_to_numa_node, memory_nodes\n"
        f"r = bind_to_numa_node({node.id}, cpus={target})\n"
        "print(json.dumps(dict(cpus=list(r.cpus), os=sorted(os.sched_getaffinity(0)), mem=r.memory_bound,"
        " applied=r.applied, nodes=memory_nodes())))"
    )
    assert res["applied"] and res["cpus"] == target and res["os"] == target
    if libnuma_available():
        assert res["mem"] and res["nodes"] == [node.id]
    else:
        assert not res["mem"]


def test_bind_whole_node_and_bad_node():
    node = numa_nodes()[0]
    res = run_child(
        "import json, os; from deepinfer_cluster import bind_to_numa_node\n"
        f"r = bind_to_numa_node({node.id}, memory=False)\n"
        "print(json.dumps(dict(cpus=sorted(os.sched_getaffinity(0)))))"
    )
    assert res["cpus"] == sorted(node.cpus)
    from deepinfer_cluster import bind_to_numa_node

    with pytest.raises(ValueError, match="numa node 99 not on this host"):
        bind_to_numa_node(99)


def test_binding_is_a_logged_noop_without_numa_information(caplog):
    before = get_cpu_affinity()
    dev = DeviceInfo(0, AcceleratorKind.NVIDIA, "NVIDIA H200")
    with caplog.at_level(logging.INFO, logger="deepinfer_cluster"):
        res = bind_device(dev, [dev])
    assert not res.applied and res.numa_node is None and get_cpu_affinity() == before
    assert "no known NUMA node; not binding" in caplog.text


def test_cores_split_between_devices_of_a_node():
    nodes = [NumaNode(0, tuple(range(8)) + tuple(range(16, 24)), tuple(range(8))),
             NumaNode(1, tuple(range(8, 16)) + tuple(range(24, 32)), tuple(range(8, 16)))]  # fmt: skip
    devices = [DeviceInfo(i, AcceleratorKind.NVIDIA, "H200", numa_node=i // 4) for i in range(8)]
    slices = [cores_for_device(d, devices, nodes) for d in devices]
    assert slices[0] == (0, 1) and slices[3] == (6, 7) and slices[4] == (8, 9) and slices[7] == (14, 15)
    # slices are disjoint and cover every physical core
    assert sorted(c for s in slices for c in s) == list(range(16))
    # more devices than cores: they share the node
    tiny = [NumaNode(0, (0,), (0,))]
    two = [DeviceInfo(i, AcceleratorKind.NVIDIA, "x", numa_node=0) for i in range(2)]
    assert cores_for_device(two[1], two, tiny) == (0,)
    with pytest.raises(ValueError, match="not among"):
        cores_for_device(DeviceInfo(0, AcceleratorKind.NVIDIA, "x", numa_node=5), two, tiny)


def test_binding_targets_of_cpu_ranks():
    nodes = [
        NumaNode(0, tuple(range(8)), tuple(range(0, 8, 2))),
        NumaNode(1, tuple(range(8, 16)), tuple(range(8, 16, 2))),
    ]
    targets = [binding_target(r, 4, [], nodes) for r in range(4)]
    assert targets == [(0, (0, 2)), (0, (4, 6)), (1, (8, 10)), (1, (12, 14))]
    assert binding_target(0, 1, [], nodes) == (0, (0, 2, 4, 6))
    # with devices, the rank follows its device; an unknown device means no binding
    devices = [DeviceInfo(i, AcceleratorKind.NVIDIA, "H200", numa_node=1 - i) for i in range(2)]
    assert binding_target(0, 2, devices, nodes, device=1) == (0, (0, 2, 4, 6))
    assert binding_target(0, 2, devices, nodes, device=5) is None
    with pytest.raises(ValueError, match="local_rank=2 out of range"):
        binding_target(2, 2, [], nodes)


def _halves_of_this_host():
    nodes = numa_nodes()
    if len(nodes) != 1 or len(nodes[0].physical_cores) < 2 or set(nodes[0].cpus) - os.sched_getaffinity(0):
        pytest.skip("needs one NUMA node with >= 2 usable physical cores")
    cores = nodes[0].physical_cores
    half = len(cores) // 2
    return list(cores[:half]), list(cores[half : 2 * half])


def test_bind_local_rank_from_launcher_environment():
    _, second = _halves_of_this_host()
    env = {**os.environ, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    code = (
        "import json, os; from deepinfer_cluster import bind_local_rank; r = bind_local_rank()\n"
        "print(json.dumps(dict(applied=r.applied, cpus=sorted(os.sched_getaffinity(0)))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, env=env
    )
    res = json.loads(out.stdout.splitlines()[-1])
    assert res == {"applied": True, "cpus": second}


def test_launcher_binds_cpu_ranks():
    first, second = _halves_of_this_host()
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer_cluster.launch", "--nproc", "2", "--bind-numa", "--", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = sorted(out.stdout.splitlines())
    assert lines == [f"[rank 0] {first}", f"[rank 1] {second}"]
