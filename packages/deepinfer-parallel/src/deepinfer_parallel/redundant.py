"""How many redundant (replica) expert slots to allocate (engine spec §7.5, model spec §6.5).

``DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS`` is a lower bound ``m``; the count actually used is the
smallest ``extra >= m`` such that ``n_routed + extra`` is divisible by the EP size:
``extra = m + ((-(n_routed + m)) mod ep_size)``. It is resolved separately for the backbone MoE and
the drafter MoE, because their routed-expert counts differ.
"""

from __future__ import annotations

import logging

from deepinfer_cluster import envs

logger = logging.getLogger(__name__)

ENV_EXTRA_EXPERTS = "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"
# Differs from the reference (whose default is 0): DeepInfer allocates 32 replica slots by default so
# that EPLB has room to act whenever EP is on.
DEFAULT_EXTRA_EXPERTS: int = envs.VARS[ENV_EXTRA_EXPERTS].default


def requested_extra_experts() -> int:
    """The lower bound from the environment (default 32)."""
    return envs.get(ENV_EXTRA_EXPERTS)


def num_redundant_experts(
    n_routed: int, ep_size: int, minimum: int | None = None, which: str = "backbone"
) -> int:
    """Smallest ``extra >= minimum`` with ``(n_routed + extra) % ep_size == 0``; logs when it rounds up.

    ``minimum`` defaults to ``DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS``; ``which`` names the MoE in the log.
    """
    if isinstance(n_routed, bool) or not isinstance(n_routed, int) or n_routed < 1:
        raise ValueError(f"n_routed must be an integer >= 1, got {n_routed!r}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size must be an integer >= 1, got {ep_size!r}")
    m = requested_extra_experts() if minimum is None else minimum
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"minimum extra experts must be an integer >= 0, got {m!r}")
    extra = m + ((-(n_routed + m)) % ep_size)
    if extra != m:
        logger.warning(
            "%s MoE: redundant experts rounded up from %d to %d so that %d routed + %d redundant "
            "= %d is divisible by ep_size=%d",
            which, m, extra, n_routed, extra, n_routed + extra, ep_size,
        )  # fmt: skip
    return extra


def resolve_redundant_experts(
    backbone_routed: int, ep_size: int, drafter_routed: int | None = None, minimum: int | None = None
) -> dict[str, int]:
    """Redundant-slot counts for the backbone and (if any) drafter MoE, each rounded on its own."""
    out = {"backbone": num_redundant_experts(backbone_routed, ep_size, minimum, "backbone")}
    if drafter_routed is not None:
        out["drafter"] = num_redundant_experts(drafter_routed, ep_size, minimum, "drafter")
    return out
