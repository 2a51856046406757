"""Parallel sizes of a run (data, context, expert parallel) and the rules that tie them together.

With R ranks (one process per device) laid out as (dp, cp) — CP groups are contiguous blocks of
`cp` ranks, DP groups take one rank of each CP block, EP groups are contiguous blocks of `ep`
ranks (spec §7.1) — a layout is valid when
    cp divides R, dp * cp == R, and ep divides dp * cp (ep defaults to R).
When R is not given it follows from the sizes the way the reference derives it: dp defaults to
max(1, ep // cp), and R = dp * cp. So `--ep 8`, `--ep 2 --dp 8` and `--ep 2 --cp 8` all mean 8 ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from . import envs

ENV_DP_SIZE = "DEEPINFER_DP_SIZE"
ENV_CP_SIZE = "DEEPINFER_CP_SIZE"
ENV_EP_SIZE = "DEEPINFER_EP_SIZE"


@dataclass(frozen=True)
class RankCoords:
    rank: int
    dp_rank: int  # which CP block (= which DP replica) the rank is in
    cp_rank: int  # position inside its CP block
    ep_rank: int  # position inside its EP block
    ep_group: int  # which EP block


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    dp: int
    cp: int
    ep: int

    def __post_init__(self) -> None:
        check_layout(self.world_size, self.dp, self.cp, self.ep)

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} out of range [0, {self.world_size})")
        return RankCoords(rank, rank // self.cp, rank % self.cp, rank % self.ep, rank // self.ep)

    def env(self) -> dict[str, str]:
        """The variables the launcher hands to every rank."""
        return {ENV_DP_SIZE: str(self.dp), ENV_CP_SIZE: str(self.cp), ENV_EP_SIZE: str(self.ep)}

    def describe(self) -> str:
        return f"world_size={self.world_size}, dp={self.dp}, cp={self.cp}, ep={self.ep}"


def _sizes(world_size, dp, cp, ep) -> str:
    return f"(world_size={world_size}, dp={dp}, cp={cp}, ep={ep})"


def check_layout(world_size: int, dp: int, cp: int, ep: int) -> None:
    """ValueError naming the broken rule and every size; nothing when the layout is possible."""
    for name, value in (("world_size", world_size), ("dp", dp), ("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1 {_sizes(world_size, dp, cp, ep)}")
    if world_size % cp:
        raise ValueError(f"cp={cp} must divide the world size {world_size} {_sizes(world_size, dp, cp, ep)}")
    if dp * cp != world_size:
        raise ValueError(
            f"dp*cp = {dp}*{cp} = {dp * cp} must equal the world size {world_size} {_sizes(world_size, dp, cp, ep)}"
        )
    if (dp * cp) % ep:
        raise ValueError(
            f"ep={ep} must divide dp*cp = {dp * cp} (EP groups are contiguous blocks of ranks) "
            f"{_sizes(world_size, dp, cp, ep)}"
        )


def resolve_layout(
    world_size: int | None = None, dp: int | None = None, cp: int | None = None, ep: int | None = None
) -> ParallelLayout:
    """Fill in the sizes left out (cp=1, dp=world/cp, ep=world) and check the result."""
    for name, value in (("world_size", world_size), ("dp", dp), ("cp", cp), ("ep", ep)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1 {_sizes(world_size, dp, cp, ep)}")
    cp = 1 if cp is None else cp
    if world_size is None:
        if dp is None and ep is None:
            raise ValueError("world size unknown: give the number of ranks or one of dp / ep")
        dp = max(1, ep // cp) if dp is None else dp
        world_size = dp * cp
    if world_size % cp:
        raise ValueError(f"cp={cp} must divide the world size {world_size} {_sizes(world_size, dp, cp, ep)}")
    dp = world_size // cp if dp is None else dp
    ep = world_size if ep is None else ep
    return ParallelLayout(world_size, dp, cp, ep)


def layout_from_env(env: Mapping[str, str] | None = None) -> ParallelLayout:
    """The layout a launched rank runs under (WORLD_SIZE and DEEPINFER_{DP,CP,EP}_SIZE)."""
    env = os.environ if env is None else env

    value = env.get("WORLD_SIZE")
    try:
        world_size = int(value) if value not in (None, "") else 1
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} is not an integer") from None
    sizes = (envs.get(name, env) for name in (ENV_DP_SIZE, ENV_CP_SIZE, ENV_EP_SIZE))
    return resolve_layout(world_size or 1, *sizes)
