"""Parallel-size rules (spec §1.4 / §7.1) and each rank's coordinates."""

from __future__ import annotations

import pytest
from deepinfer_cluster import ParallelLayout, check_layout, layout_from_env, resolve_layout
from hypothesis import given
from hypothesis import strategies as st


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # the reference's offline entry point examples: all eight ranks
        (dict(ep=8), (8, 8, 1, 8)),
        (dict(ep=2, dp=8), (8, 8, 1, 2)),
        (dict(ep=2, cp=8), (8, 1, 8, 2)),
        # the world size given (launcher --nproc): ep defaults to it, dp to world/cp
        (dict(world_size=8), (8, 8, 1, 8)),
        (dict(world_size=8, cp=4), (8, 2, 4, 8)),
        (dict(world_size=8, cp=2, ep=4), (8, 4, 2, 4)),
        (dict(world_size=1), (1, 1, 1, 1)),
    ],
)
def test_resolve_layout(args, expected):
    lay = resolve_layout(**args)
    assert (lay.world_size, lay.dp, lay.cp, lay.ep) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            dict(world_size=8, cp=3),
            r"cp=3 must divide the world size 8 \(world_size=8, dp=None, cp=3, ep=None\)",
        ),
        (dict(world_size=8, dp=2, cp=2), r"dp\*cp = 2\*2 = 4 must equal the world size 8"),
        (dict(world_size=8, ep=3), r"ep=3 must divide dp\*cp = 8 .*world_size=8, dp=8, cp=1, ep=3"),
        (dict(world_size=4, ep=8), r"ep=8 must divide dp\*cp = 4"),
        (dict(ep=3, cp=2), r"ep=3 must divide dp\*cp = 2"),
        (dict(world_size=0), r"world_size=0 must be an integer >= 1"),
        (dict(world_size=4, cp=-1), r"cp=-1 must be an integer >= 1"),
        (dict(), r"world size unknown"),
    ],
)
def test_impossible_layouts(args, message):
    with pytest.raises(ValueError, match=message):
        resolve_layout(**args)


def test_layout_object_and_env():
    lay = resolve_layout(world_size=8, cp=2, ep=4)
    assert lay.env() == {"DEEPINFER_DP_SIZE": "4", "DEEPINFER_CP_SIZE": "2", "DEEPINFER_EP_SIZE": "4"}
    again = layout_from_env({"WORLD_SIZE": "8", **lay.env()})
    assert again == lay
    assert layout_from_env({}) == ParallelLayout(1, 1, 1, 1)
    with pytest.raises(ValueError, match="DEEPINFER_CP_SIZE must be an integer, got 'x'"):
        layout_from_env({"WORLD_SIZE": "8", "DEEPINFER_CP_SIZE": "x"})
    with pytest.raises(ValueError, match="cp=3"):
        ParallelLayout(8, 2, 3, 8)
    with pytest.raises(ValueError, match=r"rank=8 out of range \[0, 8\)"):
        lay.coords(8)


def _groups_by_spec(world: int, dp: int, cp: int, ep: int):
    """§7.1 written out directly: CP = contiguous blocks of cp, DP = stride cp, EP = blocks of ep."""
    cp_groups = [list(range(s, s + cp)) for s in range(0, world, cp)]
    dp_groups = [list(range(c, world, cp)) for c in range(cp)]
    ep_groups = [list(range(s, s + ep)) for s in range(0, world, ep)]
    return cp_groups, dp_groups, ep_groups


@given(st.integers(1, 6), st.integers(1, 6), st.data())
def test_coords_match_the_group_layout(dp, cp, data):
    world = dp * cp
    ep = data.draw(st.sampled_from([e for e in range(1, world + 1) if world % e == 0]))
    check_layout(world, dp, cp, ep)
    lay = ParallelLayout(world, dp, cp, ep)
    cp_groups, dp_groups, ep_groups = _groups_by_spec(world, dp, cp, ep)
    for rank in range(world):
        c = lay.coords(rank)
        assert cp_groups[c.dp_rank][c.cp_rank] == rank
        assert dp_groups[c.cp_rank][c.dp_rank] == rank
        assert ep_groups[c.ep_group][c.ep_rank] == rank


def test_derive_layout_follows_the_reference_rule():
    from deepinfer_cluster import derive_layout

    assert derive_layout(0, 1, 8).describe() == "world_size=8, dp=8, cp=1, ep=8"  # --ep 8
    assert derive_layout(0, 8, 2).describe() == "world_size=8, dp=1, cp=8, ep=2"  # --ep 2 --cp 8
    assert derive_layout(8, 1, 2).describe() == "world_size=8, dp=8, cp=1, ep=2"  # --ep 2 --dp 8
    assert derive_layout(0, 2, 1, world_size=4).describe() == "world_size=4, dp=2, cp=2, ep=1"
    with pytest.raises(ValueError, match="context_parallel_size=3 must divide the world size 4"):
        derive_layout(0, 3, 1, world_size=4)
    with pytest.raises(ValueError, match="context_parallel_size must divide expert_parallel_size"):
        derive_layout(0, 4, 6)
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 0"):
        derive_layout(-1, 1, 1)


def test_launched_rank_reads_the_launcher_variables():
    from deepinfer_cluster import launched_rank

    assert launched_rank({}) is None
    r = launched_rank({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "DEEPINFER_EP_SIZE": "2"})
    assert (r.rank, r.local_rank, r.world_size, r.dp, r.cp, r.ep) == (3, 1, 4, None, None, 2)
    with pytest.raises(ValueError, match="WORLD_SIZE='x' is not an integer"):
        launched_rank({"RANK": "0", "WORLD_SIZE": "x"})
