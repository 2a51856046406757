"""Counter-based random numbers: a uniform that is a pure function of (seed, position, purpose).

No generator state is carried between steps, so the draw for a token cannot depend on batch
composition, chunking, preemption or the order rows are processed in. The mixing function is
SplitMix64's finaliser (a well-studied 64-bit bijection with full avalanche), applied twice.
"""

from __future__ import annotations

from enum import IntEnum

_MASK = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


class Purpose(IntEnum):
    """Which draw at a position; matches the reference's subsequence cases (spec §5.4)."""

    SAMPLE = 0  # the ordinary token draw
    RESIDUAL = 1  # resample from the residual after a rejected draft
    ACCEPT = 2  # the accept / reject uniform of speculative verification


# Draft-model sampling uses the same streams shifted by this seed offset (spec §5.4).
DRAFT_SEED_OFFSET = 1_000_000_007


def _mix64(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def stream_bits(seed: int, position: int, purpose: int = Purpose.SAMPLE) -> int:
    """64 random bits for (seed, position, purpose)."""
    subsequence = 3 * position + int(purpose)
    z = _mix64((seed + _GOLDEN_GAMMA * (subsequence + 1)) & _MASK)
    return _mix64((z + seed + _GOLDEN_GAMMA) & _MASK)


def stream_uniform(seed: int, position: int, purpose: int = Purpose.SAMPLE) -> float:
    """A float64 uniform in [0, 1) with 53 random bits."""
    return (stream_bits(seed, position, purpose) >> 11) * (1.0 / (1 << 53))
