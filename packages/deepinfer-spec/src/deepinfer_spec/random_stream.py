"""Counter-based random numbers: a uniform that is a pure function of (seed, position, purpose).

The one stream of the workspace: the model's sampler and the speculative verifier both draw from it,
so a plain decode and verification row 0 see the same uniforms. No generator state is carried
between steps, so a draw cannot depend on batch composition, chunking, preemption, on which
verification length the scheduler chose for other requests, or on row order. The mixing function
is SplitMix64's (a well-studied 64-bit bijection with full avalanche), applied twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np
import torch

_MASK = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15

# Draft-model sampling uses the target's streams with the seed shifted by this offset (spec §5.4).
DRAFT_SEED_OFFSET = 1_000_000_007
# Verification row j of a request samples at position `base + j * VERIFY_ROW_STRIDE` (spec §5.4), so
# every row has its own stream and row 0 uses exactly the position of a plain (draft-free) decode.
VERIFY_ROW_STRIDE = 10_000_019


class Purpose(IntEnum):
    """Which draw at a position; the reference's subsequence cases (spec §5.4)."""

    SAMPLE = 0  # the ordinary token draw (the fresh row after the last verified draft)
    RESIDUAL = 1  # resample from the residual after a rejected draft
    ACCEPT = 2  # the accept / reject uniform of a verified draft


def _mix64(z: int) -> int:
    # SplitMix64's finaliser: a 64-bit bijection with full avalanche.
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def stream_bits(seed: int, position: int, purpose: int = Purpose.SAMPLE) -> int:
    """64 random bits for (seed, position, purpose)."""
    seed = int(seed) & _MASK
    subsequence = 3 * int(position) + int(purpose)
    z = _mix64((seed + _GOLDEN_GAMMA * (subsequence + 1)) & _MASK)
    return _mix64((z + seed + _GOLDEN_GAMMA) & _MASK)


def stream_uniform(seed: int, position: int, purpose: int = Purpose.SAMPLE) -> float:
    """A float64 uniform in [0, 1) with 53 random bits."""
    return (stream_bits(seed, position, purpose) >> 11) * (1.0 / (1 << 53))


def verify_row_position(base_position: int, row: int) -> int:
    """Sample position of verification row `row` of a request whose plain decode position is `base`."""
    return base_position + row * VERIFY_ROW_STRIDE


def draft_position(base_position: int, num_accepted: int, step: int) -> int:
    """Sample position of draft step `step` (0-based) after `num_accepted` drafts were accepted."""
    return base_position + num_accepted + step + 1


def _mix64_array(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_uniforms(
    seeds: Sequence[int], positions: Sequence[int], purpose: int = Purpose.SAMPLE
) -> np.ndarray:
    """Vectorised `stream_uniform` (float64 [n], bit-identical): uint64 arithmetic wraps modulo 2**64
    exactly as the masked Python integers do, so the engine can draw a whole batch in one call."""
    if len(seeds) != len(positions):
        raise ValueError(
            f"seeds and positions must have the same length, got {len(seeds)} and {len(positions)}"
        )
    seed = np.array([int(s) & _MASK for s in seeds], dtype=np.uint64)
    subsequence = np.array([(3 * int(p) + int(purpose)) & _MASK for p in positions], dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _mix64_array(seed + np.uint64(_GOLDEN_GAMMA) * (subsequence + np.uint64(1)))
        bits = _mix64_array(z + seed + np.uint64(_GOLDEN_GAMMA))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _signed64(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it (torch has no full uint64 arithmetic)."""
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


def int64_bits(values: Sequence[int]) -> np.ndarray:
    """Integers (any sign, any size) reduced modulo 2**64, as int64 bit patterns: the seeds and positions
    `stream_uniforms_tensor` takes, built on the host."""
    return np.array([int(v) & _MASK for v in values], dtype=np.uint64).view(np.int64)


# the mixing constants as the int64 that hold their bit patterns
_MIX1_S64 = _signed64(0xBF58476D1CE4E5B9)
_MIX2_S64 = _signed64(0x94D049BB133111EB)
_GAMMA_S64 = _signed64(_GOLDEN_GAMMA)


def _shift_right(z: torch.Tensor, n: int) -> torch.Tensor:
    # logical shift of the 64-bit pattern: int64 `>>` is arithmetic, so clear the sign-extended bits
    return (z >> n) & ((1 << (64 - n)) - 1)


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _MIX1_S64
    z = (z ^ _shift_right(z, 27)) * _MIX2_S64
    return z ^ _shift_right(z, 31)


def stream_uniforms_tensor(
    seeds: torch.Tensor, positions: torch.Tensor, purpose: int | torch.Tensor = Purpose.SAMPLE
) -> torch.Tensor:
    """`stream_uniforms` as tensor ops on the device of `seeds` (bit-identical): `seeds` and `positions`
    int64 tensors of one shape holding the 64-bit patterns (`int64_bits`; a position that fits in int64
    is its own pattern), or positions computed on the device from such tensors (an accepted count
    that only the device knows yet); `purpose` one for all, or an int64 tensor of them (several kinds
    of draws in one pass: each op is a kernel launch on the GPU). int64 multiplication and addition wrap
    modulo 2**64 like the masked Python integers; no host sync, so it can run inside a captured graph.
    -> float64 tensor."""
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(
            f"seeds and positions must be int64 tensors, got {seeds.dtype} and {positions.dtype}"
        )
    subsequence = positions * 3 + (purpose if isinstance(purpose, torch.Tensor) else int(purpose))
    z = _mix64_tensor(seeds + (subsequence + 1) * _GAMMA_S64)
    bits = _mix64_tensor(z + seeds + _GAMMA_S64)
    return _shift_right(bits, 11).to(torch.float64) * (1.0 / (1 << 53))
