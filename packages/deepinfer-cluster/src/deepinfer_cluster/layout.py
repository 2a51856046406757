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


@dataclass(frozen=True)
class LaunchedRank:
    """This process as one rank of a world started by `deepinfer launch` or torchrun: its rank, its
    index on this host (which device it takes), the world size, and the sizes the launcher exported
    (None where it exported none: torchrun exports no DEEPINFER_*_SIZE)."""

    rank: int
    local_rank: int
    world_size: int
    dp: int | None
    cp: int | None
    ep: int | None


def launched_rank(env: Mapping[str, str] | None = None) -> LaunchedRank | None:
    """The rank this process is, when a launcher started it (RANK and WORLD_SIZE set, as
    `deepinfer launch` and torchrun set them); None otherwise. The rendezvous itself (MASTER_ADDR,
    MASTER_PORT) is read by torch.distributed's `env://` initialisation."""
    env = os.environ if env is None else env
    if env.get("RANK") in (None, "") or env.get("WORLD_SIZE") in (None, ""):
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = env.get(name) or ("0" if name == "LOCAL_RANK" else "")
        try:
            values[name] = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None
    world, rank = values["WORLD_SIZE"], values["RANK"]
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    dp, cp, ep = (envs.get(name, env) for name in (ENV_DP_SIZE, ENV_CP_SIZE, ENV_EP_SIZE))
    return LaunchedRank(rank, values["LOCAL_RANK"], world, dp, cp, ep)


def derive_layout(dp: int, cp: int, ep: int, world_size: int | None = None) -> ParallelLayout:
    """The reference's derivation of a run's sizes (engine spec §1.4): ``dp == 0`` means derived, as
    ``world_size // cp`` when the world size is known (a launched run), else ``max(1, ep // cp)``; then
    the layout rules (cp divides the world, dp*cp is the world, ep divides dp*cp). ValueError naming the
    broken rule with the engine's field names."""
    for name, value, low in (("data_parallel_size", dp, 0), ("context_parallel_size", cp, 1),
                             ("expert_parallel_size", ep, 1)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    given = f"(data_parallel_size={dp or 'derived'}, context_parallel_size={cp}, expert_parallel_size={ep}"
    given += f", world size {world_size})" if world_size is not None else ")"
    if world_size is not None and world_size % cp:
        raise ValueError(f"context_parallel_size={cp} must divide the world size {world_size} {given}")
    if dp == 0:
        dp = world_size // cp if world_size is not None else max(1, ep // cp)
    world = dp * cp
    if world_size is not None and world != world_size:
        raise ValueError(
            f"data_parallel_size * context_parallel_size = {dp}*{cp} = {world} must equal the world size "
            f"{world_size} {given}"
        )
    if world % ep:
        allowed = [d for d in range(1, world + 1) if world % d == 0]
        hint = (
            f"; with data_parallel_size derived as max(1, expert_parallel_size // context_parallel_size) = "
            f"{dp}, context_parallel_size must divide expert_parallel_size or be a multiple of it"
            if "derived" in given and world_size is None
            else ""
        )
        raise ValueError(
            f"expert_parallel_size must divide data_parallel_size * context_parallel_size = {world} "
            f"(one of {allowed}: EP groups are contiguous blocks of ranks), got {ep} {given}{hint}"
        )
    return ParallelLayout(world, dp, cp, ep)
