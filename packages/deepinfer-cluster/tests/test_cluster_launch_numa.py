"""The launcher binds ranks to NUMA nodes by default where the host has several, says so at start, and
does nothing on a one-node host; `--no-bind-numa` opts out. The decision is checked on synthetic hosts
(a recorded two-socket `lscpu -p`, devices with known nodes) and, on this machine, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deepinfer_cluster import AcceleratorKind, DeviceInfo, NumaNode, numa_nodes, parse_lscpu_parsable
from deepinfer_cluster.launch import build_parser, make_plan, numa_decision

DATA = Path(__file__).parent / "data"
TWO_SOCKETS = parse_lscpu_parsable((DATA / "lscpu_2socket_smt2.txt").read_text())
ONE_NODE = [NumaNode(0, tuple(range(8)), tuple(range(8)))]


def plan(argv: list[str], host, kind=AcceleratorKind.CPU):
    args = build_parser().parse_args(argv)
    return make_plan(args, ["true"], kind=kind, host=host)


def test_decision_follows_the_number_of_nodes_and_the_flags():
    assert len(TWO_SOCKETS) == 2
    assert numa_decision(None, TWO_SOCKETS) == (
        True,
        "NUMA: binding each rank to its node's cores and memory (2 nodes on this host)",
    )
    bind, why = numa_decision(None, ONE_NODE)
    assert not bind and "1 node on this host; ranks not bound" in why
    assert numa_decision(True, ONE_NODE)[0]  # --bind-numa: asked for, so even on one node
    bind, why = numa_decision(False, TWO_SOCKETS)
    assert not bind and "--no-bind-numa" in why
    assert numa_decision(None, []) == (False, "NUMA: no NUMA information on this host; ranks not bound")


def test_cpu_ranks_fill_the_nodes_of_a_two_socket_host_by_default():
    p = plan(["--nproc", "4"], ([], TWO_SOCKETS))
    nodes = [b[0] for b in p.numa_binding]
    assert nodes == [0, 0, 1, 1]
    cores = [set(b[1]) for b in p.numa_binding]
    assert all(c <= set(TWO_SOCKETS[n].physical_cores) for c, n in zip(cores, nodes))
    assert not cores[0] & cores[1] and not cores[2] & cores[3]  # each rank its own cores
    assert "2 nodes on this host" in p.numa_report
    off = plan(["--nproc", "4", "--no-bind-numa"], ([], TWO_SOCKETS))
    assert off.numa_binding == [None] * 4 and "--no-bind-numa" in off.numa_report


def test_gpu_ranks_follow_their_device_node(monkeypatch):
    devices = [DeviceInfo(i, AcceleratorKind.NVIDIA, "H200", numa_node=1 - i // 2) for i in range(4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    p = plan(["--nproc", "4", "--devices-per-rank", "1"], (devices, TWO_SOCKETS), AcceleratorKind.NVIDIA)
    assert [b[0] for b in p.numa_binding] == [1, 1, 0, 0]
    one = plan(["--nproc", "2"], (devices, ONE_NODE), AcceleratorKind.NVIDIA)
    assert one.numa_binding == [None, None] and "nothing to choose" in one.numa_report


def test_launcher_reports_the_decision_and_leaves_a_one_node_host_alone():
    if len(numa_nodes()) != 1:
        pytest.skip("this check is for a one-node host")
    code = "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"
    res = subprocess.run(
        [sys.executable, "-m", "deepinfer_cluster.launch", "--nproc", "2", "--", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "NUMA: 1 node on this host; ranks not bound (nothing to choose)" in res.stderr
    mine = sorted(os.sched_getaffinity(0))
    for line in res.stdout.splitlines():
        assert json.loads(line.split("] ", 1)[1]) == mine  # affinity inherited, not narrowed
