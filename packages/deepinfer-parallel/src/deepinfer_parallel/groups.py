"""Process groups: data parallel (DP), context parallel (CP), expert parallel (EP), Engram sharding (ENP).

Layout (engine spec §7.1), with ranks ``0..R-1`` and ``R = max(enp, dp*cp)``:

* ``cp``: contiguous blocks of ``cp`` ranks;
* ``dp``: ranks with the same CP index inside one ``(replica, dp, cp)`` block, i.e. stride ``cp``;
* ``ep``: contiguous blocks of ``ep`` ranks (the whole world when ``ep == R``);
* ``enp``: contiguous blocks of ``enp`` ranks.

There is no tensor parallelism: attention is data parallel (optionally context parallel) and the
experts are expert parallel.

The dp/cp/ep rules are ``deepinfer_cluster.check_layout`` (the launcher uses the same function, so
both agree); the Engram size ``enp`` is checked here, since only this package knows about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepinfer_cluster import check_layout


@dataclass(frozen=True)
class ParallelSizes:
    """Validated sizes; ``world`` is ``max(enp, dp*cp)``."""

    dp: int
    cp: int
    ep: int
    enp: int
    world: int


def validate_parallel_sizes(
    world_size: int, dp: int = 1, cp: int = 1, ep: int = 1, enp: int = 1
) -> ParallelSizes:
    """Check the sizes against the world size; raise ``ValueError`` naming the offending sizes."""
    for name, value in (("world_size", world_size), ("dp", dp), ("cp", cp), ("ep", ep), ("enp", enp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    attention = dp * cp
    expected = max(enp, attention)
    if world_size != expected:
        raise ValueError(
            f"world_size={world_size} must equal max(enp, dp*cp) = max({enp}, {dp}*{cp}) = {expected}"
        )
    if ep > world_size:
        raise ValueError(f"ep={ep} must not exceed world_size={world_size}")
    if enp > attention:
        # Engram-only ranks beyond the attention ranks: the (replica, dp, cp) blocks must tile the world.
        if world_size % attention:
            raise ValueError(f"dp*cp = {dp}*{cp} = {attention} must divide world_size={world_size}")
        if world_size % ep:
            raise ValueError(f"ep={ep} must divide world_size={world_size}")
    else:
        check_layout(world_size, dp, cp, ep)
    if world_size % enp:
        raise ValueError(f"enp={enp} must divide world_size={world_size}")
    return ParallelSizes(dp=dp, cp=cp, ep=ep, enp=enp, world=world_size)


def group_layout(sizes: ParallelSizes) -> dict[str, list[list[int]]]:
    """Rank lists of every group kind (a pure function of the sizes; every rank computes the same)."""
    r, dp, cp = sizes.world, sizes.dp, sizes.cp
    block = dp * cp
    dp_groups = [[start + d * cp + c for d in range(dp)] for start in range(0, r, block) for c in range(cp)]
    return {
        "dp": dp_groups,
        "cp": [list(range(s, s + cp)) for s in range(0, r, cp)],
        "ep": [list(range(s, s + sizes.ep)) for s in range(0, r, sizes.ep)],
        "enp": [list(range(s, s + sizes.enp)) for s in range(0, r, sizes.enp)],
    }


@dataclass
class GroupHandle:
    """One process group this rank belongs to, with its member ranks and this rank's index in it."""

    group: dist.ProcessGroup | None
    ranks: list[int]
    rank_in_group: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelState:
    """The groups of this rank; ``dp``/``cp``/``ep``/``enp`` hold device groups, ``cpu_*`` gloo copies."""

    sizes: ParallelSizes
    rank: int
    dp: GroupHandle
    cp: GroupHandle
    ep: GroupHandle
    enp: GroupHandle
    cpu_dp: GroupHandle
    cpu_cp: GroupHandle
    cpu_ep: GroupHandle
    backend: str
    extra: dict = field(default_factory=dict)


_STATE: ParallelState | None = None


def init_parallel(
    dp: int = 1, cp: int = 1, ep: int = 1, enp: int = 1, backend: str | None = None
) -> ParallelState:
    """Create all groups of the spec layout on an initialised default process group.

    Every rank must call this with the same sizes (``new_group`` is collective over the world).
    ``backend`` is the device-group backend (``gloo`` on CPU, ``nccl`` on NVIDIA); ``None`` picks
    the default group's backend. The ``cpu_*`` copies always use gloo (control plane under ZOS).
    """
    global _STATE
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_parallel needs torch.distributed initialised (init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = validate_parallel_sizes(world, dp=dp, cp=cp, ep=ep, enp=enp)
    backend = backend or dist.get_backend()
    layout = group_layout(sizes)

    def make(kind: str, group_backend: str) -> GroupHandle:
        mine = None
        for ranks in layout[kind]:
            # new_group must be entered by every rank for every group, in the same order.
            group = dist.new_group(ranks, backend=group_backend)
            if rank in ranks:
                mine = GroupHandle(group, ranks, ranks.index(rank))
        assert mine is not None
        return mine

    state = ParallelState(
        sizes=sizes,
        rank=rank,
        dp=make("dp", backend),
        cp=make("cp", backend),
        ep=make("ep", backend),
        enp=make("enp", backend),
        cpu_dp=make("dp", "gloo"),
        cpu_cp=make("cp", "gloo"),
        cpu_ep=make("ep", "gloo"),
        backend=backend,
    )
    if backend == "nccl":
        # Communicators are created lazily; one all-reduce each makes the first real collective fast.
        for handle in (state.dp, state.cp, state.ep, state.enp):
            dist.all_reduce(torch.zeros(1, device="cuda"), group=handle.group)
    _STATE = state
    return state


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("init_parallel() has not been called in this process")
    return _STATE


def destroy_parallel() -> None:
    """Forget the groups (the default process group is left to its owner)."""
    global _STATE
    _STATE = None
