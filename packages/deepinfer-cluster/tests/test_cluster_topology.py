"""Link matrices from `nvidia-smi topo -m` text and the peak-rate table."""

from __future__ import annotations

from pathlib import Path

import pytest
from deepinfer_cluster import (
    LinkKind,
    Topology,
    known_models,
    lookup_peak_rates,
    parse_nvidia_smi_topo,
    peak_rates,
    topology_from_links,
)
from deepinfer_cluster.topology import Link, parse_link

DATA = Path(__file__).parent / "data"


def test_hgx_h200_nvswitch_host():
    topo = parse_nvidia_smi_topo((DATA / "h200x8_nvlink_topo.txt").read_text())
    assert topo.num_devices == 8
    for a in range(8):
        for b in range(8):
            expected = Link(LinkKind.SELF) if a == b else Link(LinkKind.NVLINK, 18)
            assert topo.link(a, b) == expected
    assert topo.nvlink_domains() == [tuple(range(8))]
    assert topo.nvlink_domain_size() == 8
    assert topo.within_nvlink_domain(range(8))
    assert topo.numa_nodes == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.devices_on_numa(1) == [4, 5, 6, 7]
    assert topo.same_numa(0, 3) and not topo.same_numa(3, 4)
    assert topo.cpu_affinity[0] == tuple(range(0, 48)) + tuple(range(96, 144))
    assert topo.cpu_affinity[7] == tuple(range(48, 96)) + tuple(range(144, 192))
    assert topo.nic_names == [f"mlx5_{k}" for k in range(8)]
    assert [topo.nearest_nic(g) for g in range(8)] == [f"mlx5_{k}" for k in range(8)]
    assert "NV18" in topo.matrix_text()


def test_pcie_host_without_nvlink():
    topo = parse_nvidia_smi_topo((DATA / "h100pcie4_topo.txt").read_text())
    assert topo.link(0, 1).kind is LinkKind.PXB and topo.link(1, 2).kind is LinkKind.SYS
    assert topo.nvlink_domain_size() == 1
    assert topo.nvlink_domains() == [(0,), (1,), (2,), (3,)]
    assert not topo.within_nvlink_domain([0, 1]) and topo.within_nvlink_domain([2])
    assert topo.numa_nodes == [0, 0, 1, 1]
    assert topo.same_numa(0, 1) and not topo.same_numa(1, 2)
    # closeness orders: same switch beats across sockets
    assert topo.link(0, 1).kind < topo.link(0, 2).kind
    assert topo.nearest_nic(3) == "mlx5_1"


def test_captured_h200x2_topology():
    text = (DATA / "captured_h200x2/nvidia_smi_topo.txt").read_text()
    assert "\x1b[4m" in text  # the real header carries terminal escape codes
    topo = parse_nvidia_smi_topo(text)
    assert topo.link(0, 1) == Link(LinkKind.NVLINK, 18)
    assert topo.nvlink_domain_size() == 2
    assert topo.numa_nodes == [0, 0] and topo.cpu_affinity == [tuple(range(32))] * 2
    assert topo.nic_names == []


def test_nvlink_bridge_pairs():
    # Two PCIe cards bridged pairwise (A100 / H100 PCIe with NVLink bridges)
    topo = topology_from_links(
        [
            ["X", "NV12", "SYS", "SYS"],
            ["NV12", "X", "SYS", "SYS"],
            ["SYS", "SYS", "X", "NV12"],
            ["SYS", "SYS", "NV12", "X"],
        ],
        numa_nodes=[0, 0, 1, 1],
    )
    assert topo.nvlink_domains() == [(0, 1), (2, 3)]
    assert topo.nvlink_domain_size() == 2
    assert topo.within_nvlink_domain([2, 3]) and not topo.within_nvlink_domain([1, 2])


def test_link_tokens_and_bad_input():
    assert parse_link(" X ") == Link(LinkKind.SELF)
    assert parse_link("NV4") == Link(LinkKind.NVLINK, 4)
    assert parse_link("SOC").kind is LinkKind.SYS
    assert parse_link("???").kind is LinkKind.UNKNOWN
    assert LinkKind.NODE.within_numa_node and not LinkKind.SYS.within_numa_node
    with pytest.raises(ValueError, match="no header"):
        parse_nvidia_smi_topo("nothing here\n")
    with pytest.raises(ValueError, match="no row for GPU1"):
        parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X \tNV18\n")
    with pytest.raises(ValueError, match="diagonal"):
        parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\tNV18\tNV18\nGPU1\tNV18\t X \n")
    with pytest.raises(ValueError, match="square"):
        Topology([[Link(LinkKind.SELF)], []], [None, None], [(), ()])
    topo = topology_from_links([["X"]])
    with pytest.raises(ValueError, match=r"device 3 out of range \[0, 1\)"):
        topo.link(0, 3)


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"),
    ],
)
def test_peak_rate_lookup(name, model):
    assert lookup_peak_rates(name).model == model


def test_peak_rate_values_and_overrides():
    h200, h100 = lookup_peak_rates("NVIDIA H200"), lookup_peak_rates("NVIDIA H100 80GB HBM3")
    # The Hopper chip is the same: equal math rates, more bandwidth on the H200
    assert h200.bf16_tflops == h100.bf16_tflops and h200.hbm_tbps > h100.hbm_tbps
    # fp8 tensor cores run at twice the bf16 rate on Hopper and Blackwell
    for model in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA H200", "NVIDIA B200", "NVIDIA GB200"):
        r = lookup_peak_rates(model)
        assert r.fp8_tflops == pytest.approx(2 * r.bf16_tflops, rel=1e-3), model
    # Ridge points quoted in the GPU machine's notes: ~206 (H200) and ~295 (H100) FLOP/byte
    assert h200.ridge_flops_per_byte == pytest.approx(206, abs=1)
    assert h100.ridge_flops_per_byte == pytest.approx(295, abs=1)
    # The reference's stats ceilings for SM100 parts (spec §7.6): 2250 (B200), 2500 (GB200)
    assert lookup_peak_rates("NVIDIA B200").bf16_tflops == 2250
    assert lookup_peak_rates("NVIDIA GB200").bf16_tflops == 2500
    assert lookup_peak_rates("NVIDIA A100-SXM4-80GB").fp8_tflops is None
    measured = peak_rates("NVIDIA H200", measured={"bf16_tflops": 788.0, "hbm_tbps": 4.3})
    assert (measured.bf16_tflops, measured.hbm_tbps, measured.fp8_tflops, measured.source) == (
        788.0,
        4.3,
        1979.0,
        "measured",
    )
    assert peak_rates("NVIDIA H200") == h200
    assert lookup_peak_rates("Tesla T4") is None
    with pytest.raises(ValueError, match="not in the peak-rate table"):
        peak_rates("Tesla T4")
    t4 = peak_rates("Tesla T4", measured={"bf16_tflops": 65.0, "hbm_tbps": 0.32})
    assert t4.bf16_tflops == 65.0 and t4.fp8_tflops is None
    with pytest.raises(ValueError, match="must be > 0"):
        h200.with_measured(hbm_tbps=0)
    with pytest.raises(ValueError, match="unknown field"):
        h200.with_measured(fp4_tflops=1.0)
    assert "GB200" in known_models()
