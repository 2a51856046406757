"""Visible-device variables (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES) and rank assignment.

A rank that owns `per_rank` devices sees physical devices
`visible[offset + rank*per_rank : offset + (rank+1)*per_rank]`, where `visible` is what the parent
process was allowed to see (its own visible list, else every physical device).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence

from deepinfer_cluster.accelerator import AcceleratorKind, accelerator_kind, physical_device_ids


def visible_devices_var(kind: AcceleratorKind | str | None = None) -> str | None:
    """Name of the visible-device variable for `kind` (this host's kind by default); None on CPU."""
    kind = accelerator_kind() if kind is None else AcceleratorKind(kind)
    return kind.visible_devices_var


def parse_visible_devices(value: str, var: str = "CUDA_VISIBLE_DEVICES") -> list[int]:
    """'0,1,3' -> [0, 1, 3]. Only integer ids are supported (not GPU UUIDs / MIG names)."""
    ids = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        if not item.isdigit():
            raise ValueError(
                f"{var}={value!r}: entry {item!r} is not a device index (UUIDs are not supported)"
            )
        ids.append(int(item))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{var}={value!r}: a device is listed twice")
    return ids


def visible_devices(
    kind: AcceleratorKind | str | None = None, env: Mapping[str, str] | None = None
) -> list[int]:
    """Physical ids this process may use: the visible variable if set, else all physical devices."""
    kind = accelerator_kind() if kind is None else AcceleratorKind(kind)
    env = os.environ if env is None else env
    var = kind.visible_devices_var
    if var is not None and var in env:
        return parse_visible_devices(env[var], var)
    return physical_device_ids(kind)


def devices_for_rank(rank: int, per_rank: int, visible: Sequence[int], offset: int = 0) -> list[int]:
    """The slice of `visible` that rank `rank` owns; ValueError when the host has too few."""
    if per_rank < 1:
        raise ValueError(f"per_rank={per_rank}: must be >= 1")
    if rank < 0 or offset < 0:
        raise ValueError(f"rank={rank}, offset={offset}: both must be >= 0")
    start = offset + rank * per_rank
    end = start + per_rank
    if end > len(visible):
        raise ValueError(
            f"rank {rank} needs devices [{start}, {end}) of the {len(visible)} visible ({list(visible)}); "
            f"per_rank={per_rank}, offset={offset}"
        )
    return list(visible[start:end])


def assign_visible_devices(
    rank: int,
    per_rank: int = 1,
    offset: int = 0,
    kind: AcceleratorKind | str | None = None,
    env: MutableMapping[str, str] | None = None,
) -> list[int]:
    """Narrow `env`'s visible-device variable (os.environ by default) to this rank's devices.

    Must run before the runtime (torch.cuda, torch_npu) initialises. Returns the physical ids.
    """
    kind = accelerator_kind() if kind is None else AcceleratorKind(kind)
    env = os.environ if env is None else env
    var = kind.visible_devices_var
    if var is None:
        raise ValueError(f"accelerator kind {kind.value!r} has no visible-device variable")
    mine = devices_for_rank(rank, per_rank, visible_devices(kind, env), offset)
    env[var] = ",".join(map(str, mine))
    return mine
