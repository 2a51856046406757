"""Cached FP64 operand copies of weights for the CPU exact-product GEMMs: a weight as row-major [K, N] parts
of at most 24 significant bits (`_row_major`, for `row_gemm`) and stacked experts as one [E, K, N] operand
(`stacked_parts`, for `grouped_gemm`), parts of one stack within one memory budget (`PART_CACHE_BYTES`)."""

from __future__ import annotations

import weakref

import torch

from .cpu_gemm import WIDE_BYTES
from .fp32_values import _fp32_valued, version_of

COL_PAD = 16  # weight columns of `row_gemm` padded to a multiple of this (an odd N changed row bits)

# Row-major [K, N_pad] FP64 copies of weights for `row_gemm`, made once per weight (a copy per call
# cost more than the GEMM for small M), with whether their values are FP32-valued. Keyed by the id of
# the tensor that owns the storage (callers pass fresh `.t()` views of a cached FP64 weight) plus the
# view's geometry, guarded by a weak reference to the owner and its in-place version counter (shared
# by all its views), like `numerics.weight_fp64`.
_ROW_MAJOR: dict[
    int, tuple[weakref.ref, dict[tuple, tuple[int, list[torch.Tensor], torch.Tensor | None]]]
] = {}
# Bytes of cached copies of parts of one owner (experts of a stack); past PART_CACHE_BYTES per stack the
# remaining parts are converted per call instead (the conversion cost the mode ~1 ms per expert call on
# the tiny model; a large checkpoint's experts in FP64 would not fit in memory).
PART_CACHE_BYTES = 256 << 20
_part_bytes: dict[int, int] = {}


def _split18(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Veltkamp split of FP64 `t` into hi (at most 18 significant bits) + rest (exactly `t` - hi)."""
    c = t * float(2**35 + 1)
    hi = c - (c - t)
    return hi, t - hi


def _parts(w_t: torch.Tensor) -> list[torch.Tensor]:
    """`w_t` [K, N] as contiguous FP64 [K, N + pad] parts (zero columns up to a multiple of `COL_PAD`)
    that sum to it exactly, each with at most 24 significant bits: the weight itself when it is
    FP32-valued (every dequantised checkpoint weight), else three parts of at most 18 bits."""
    k, n = w_t.shape
    out = w_t.new_zeros(k, n + (-n) % COL_PAD, dtype=torch.float64)
    out[:, :n] = w_t  # exact widening: the same values as numerics.weight_fp64
    return _short_parts(out, _fp32_valued(w_t))


def _short_parts(b: torch.Tensor, fp32_valued: bool | None = None) -> list[torch.Tensor]:
    """Contiguous FP64 `b` as parts of at most 24 significant bits that sum to it exactly."""
    b = b.contiguous()
    if fp32_valued if fp32_valued is not None else _fp32_valued(b):
        return [b]
    p0, rest = _split18(b)
    p1, p2 = _split18(rest)
    return [p0, p1, p2]


def _row_major(w_t: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`_parts` of `w_t` (any float dtype; a view such as `weight.t()` or `experts.w1[e].t()`), cached per
    view of its owner, and for a cached wide FP32-valued weight (at least `WIDE_BYTES` in FP64) its [N_pad,
    K] copy for `_cpu_gemm`'s `b_nt` (else None)."""
    owner = w_t._base if w_t._base is not None else w_t
    if version_of(owner) is None:  # an in-place change (an EPLB weight shuffle) could not be seen: no cache
        return _parts(w_t), None
    if owner.numel() != w_t.numel() and _part_bytes.get(id(owner), 0) + 8 * w_t.numel() > PART_CACHE_BYTES:
        # a part of a larger tensor (one expert of a stack, taken anew per call) past the budget:
        # converted per call like `numerics.weight_fp64` does (FP64 copies of every expert of a large
        # checkpoint would not fit); below it (small models) converted once, like whole weights
        return _parts(w_t), None
    sub = (w_t.storage_offset(), tuple(w_t.shape), tuple(w_t.stride()))
    entry = _ROW_MAJOR.get(id(owner))
    if entry is not None and entry[0]() is not owner:
        entry = None
    if entry is not None:
        hit = entry[1].get(sub)
        if hit is not None and hit[0] == version_of(owner):
            return hit[1], hit[2]
    else:
        entry = (weakref.ref(owner), {})
        _ROW_MAJOR[id(owner)] = entry
        weakref.finalize(owner, _ROW_MAJOR.pop, id(owner), None)
        weakref.finalize(owner, _part_bytes.pop, id(owner), None)
    parts = _parts(w_t)
    nt = parts[0].t().contiguous() if len(parts) == 1 and 8 * parts[0].numel() >= WIDE_BYTES else None
    if owner.numel() != w_t.numel() and sub not in entry[1]:
        _part_bytes[id(owner)] = _part_bytes.get(id(owner), 0) + sum(8 * p.numel() for p in parts)
    entry[1][sub] = (version_of(owner), parts, nt)
    return parts, nt


# Row-major FP64 copies of stacked weights for `grouped_gemm`: stacks [E, N_i, K] (or one [N, K] weight)
# concatenated along N, keyed by the ids of the source tensors, guarded by weak references and their
# in-place version counters (as `_ROW_MAJOR`); None where they are not FP32-valued or over the budget.
_STACKS: dict[tuple[int, ...], tuple[tuple, tuple[int, ...], torch.Tensor | None]] = {}
GEMM_NAIVE_ELEMENTS = 400  # torch's CPU bmm takes a naive loop kernel below this many M*N*K (not MKL)


def stacked_parts(*weights: torch.Tensor, groups: int | None = None) -> torch.Tensor | None:
    """`weights` (each [E, N_i, K] stacked experts or one [N_i, K] weight, same E and K) as one cached
    contiguous FP64 [E, K, sum N_i + pad] operand for `grouped_gemm`: expert e's [K, N_i] blocks side by
    side (zero columns up to a multiple of `COL_PAD`). None when some weight is not FP32-valued (the
    exact products `grouped_gemm` relies on need at most 24 significant bits) or when the copy would
    exceed `PART_CACHE_BYTES` (a large checkpoint's experts in FP64) or K * N is below
    `GEMM_NAIVE_ELEMENTS`: callers then take `row_gemm` per expert.

    `groups` (one [groups * N_g, K] weight only): the weight as a stack of `groups` [N_g, K] blocks (the
    attention's grouped output projection `wo_a`), cached under the weight itself."""
    if groups is not None:
        if len(weights) != 1 or weights[0].dim() != 2 or weights[0].shape[0] % groups:
            raise ValueError(
                f"stacked_parts: groups = {groups} needs one 2-D weight whose rows it divides, got "
                f"{[tuple(w.shape) for w in weights]}"
            )
    versions = tuple(version_of(w) for w in weights)
    cache = None not in versions  # inference tensors: built per call (a change in place would go unseen)
    key = tuple(id(w) for w in weights) + ((-groups,) if groups is not None else ())
    hit = _STACKS.get(key) if cache else None
    if hit is not None and all(r() is w for r, w in zip(hit[0], weights, strict=True)):
        if hit[1] == versions:
            return hit[2]
    elif hit is None and cache:
        for w in weights:
            weakref.finalize(w, _STACKS.pop, key, None)
    if groups is not None:
        stacks = [weights[0].view(groups, -1, weights[0].shape[1])]
    else:
        stacks = [w if w.dim() == 3 else w.unsqueeze(0) for w in weights]
    e, _, k = stacks[0].shape
    if any(s.shape[0] != e or s.shape[2] != k for s in stacks):
        raise ValueError(
            f"stacked_parts: weights must share E and K, got {[tuple(w.shape) for w in weights]}"
        )
    n = sum(s.shape[1] for s in stacks)
    n_pad = n + (-n) % COL_PAD
    out = None
    small = k * n_pad < GEMM_NAIVE_ELEMENTS  # (not a concern for any real projection)
    if not small and 8 * e * k * n_pad <= PART_CACHE_BYTES and all(_fp32_valued(s) for s in stacks):
        out = stacks[0].new_zeros(e, k, n_pad, dtype=torch.float64)
        col = 0
        for s in stacks:
            out[:, :, col : col + s.shape[1]] = s.transpose(1, 2)  # exact widening
            col += s.shape[1]
    if cache:
        _STACKS[key] = (tuple(weakref.ref(w) for w in weights), versions, out)
    return out
