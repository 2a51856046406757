"""Process-group layout, validation of sizes, and DP / CP / EP groups on a real gloo world."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from deepinfer_parallel import group_layout, init_parallel, validate_parallel_sizes
from deepinfer_parallel.launch import run_distributed


def test_layout_matches_spec_for_dp2_cp2_ep4():
    layout = group_layout(validate_parallel_sizes(4, dp=2, cp=2, ep=4))
    assert layout["cp"] == [[0, 1], [2, 3]]  # contiguous blocks of cp
    assert layout["dp"] == [[0, 2], [1, 3]]  # same CP index, stride cp
    assert layout["ep"] == [[0, 1, 2, 3]]
    assert layout["enp"] == [[0], [1], [2], [3]]


def test_layout_with_engram_replicas():
    layout = group_layout(validate_parallel_sizes(8, dp=2, cp=2, ep=4, enp=8))
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["enp"] == [list(range(8))]


def test_every_rank_in_exactly_one_group_of_each_kind():
    sizes = validate_parallel_sizes(16, dp=4, cp=4, ep=8, enp=2)
    for kind, groups in group_layout(sizes).items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(16)), kind


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 1, 3, 1), "world_size=4 must equal max\\(enp, dp\\*cp\\) = max\\(1, 1\\*3\\) = 3"),
        ((4, 2, 2, 8), "ep=8 must not exceed world_size=4"),
        ((4, 2, 2, 3), "ep=3 must divide dp\\*cp = 4"),
        ((6, 3, 2, 4), "ep=4 must divide dp\\*cp = 6"),
        ((4, 0, 2, 1), "dp must be an integer >= 1, got 0"),
    ],
)
def test_bad_sizes_raise_naming_them(args, message):
    with pytest.raises(ValueError, match=message):
        validate_parallel_sizes(*args)


def test_bad_engram_size():
    with pytest.raises(ValueError, match="enp=3 must divide world_size=4"):
        validate_parallel_sizes(4, dp=4, cp=1, ep=4, enp=3)


def _groups_worker(rank, world):
    state = init_parallel(dp=2, cp=2, ep=4)
    assert state.cp.ranks == [rank - rank % 2, rank - rank % 2 + 1]
    assert state.dp.ranks == [rank % 2, rank % 2 + 2]
    # A collective in each group sees exactly its members.
    for handle, expected in (
        (state.dp, state.dp.ranks),
        (state.cp, state.cp.ranks),
        (state.ep, list(range(4))),
    ):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=handle.group)
        assert t.item() == sum(expected)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=state.cpu_dp.group)
    assert t.item() == sum(state.dp.ranks)


@pytest.mark.distributed
def test_dp_cp_ep_groups_on_gloo():
    run_distributed(_groups_worker, 4)


def _multicast_env_worker(rank, world):
    from deepinfer_cluster.launch import NO_MULTICAST_ENV

    for key, value in NO_MULTICAST_ENV.items():
        assert os.environ.get(key) == value, (key, os.environ.get(key))


def test_ranks_start_with_nvlink_multicast_off_and_the_caller_keeps_its_environment(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    run_distributed(_multicast_env_worker, 2)
    assert os.environ["NCCL_NVLS_ENABLE"] == "1" and "NVSHMEM_DISABLE_NVLS" not in os.environ
