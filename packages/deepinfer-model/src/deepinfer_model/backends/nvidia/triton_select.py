"""The indexer's top-k of 16-bit scores (`topk_indices`) as one Triton radix select per row.

Why: `layers.indexer._select_topk_keys` ranks unique int32 keys with `torch.topk` (a multi-pass radix select
over the whole [T, n] tensor) and then sorts the k picked indices: 7.8 + 1.4 ms of a 16k-token medium V4.1
prefill step on the H200 (8 calls of [8192, 8-16k] with k = 512). Here one program owns a row. A row of at
most `ROW_MAX` entries is held in registers (`_select_row_kernel`): a binary search over the 16-bit score key
finds the k-th best score (16 compare-and-count steps over the registers), then one pass picks. A longer row
is streamed (`_select_kernel`: 3.1 ms per [16384, 16384] call on an H100 against torch.topk + sort's 4.7,
far from the row's bandwidth - presumably its histograms' atomics serialising on the few bins concentrated
scores share; on the H200 the register version took 2.94 ms per [16384, 16384] call, the streamed 3.02): two
histogram passes over the row's score keys (the high byte, then the low byte among the entries that share
the chosen high byte) find the k-th best score exactly; a last pass picks every entry above it and, of those
equal to it, the first ones in index order (the reference's keys break ties by the lower index), and writes
the picks in index order (a running prefix count gives each its slot): ascending without a sort. The row
(2 bytes of score and 1 of validity per entry) is re-read from L2 by each pass.

Score keys are the `topk_keys` op's key16 (the sign-magnitude bits as two's complement, -0.0 and +0.0 both
0), offset by 32768, with 0 for entries that are not valid. Exactly the reference's selection (no
floating-point arithmetic). Plain `.py` (Triton reads the source).
"""

import torch
import triton
import triton.language as tl

from .triton_keys import score_key16

BLOCK = 2048  # entries per step of each pass
OUT_BLOCK = 512  # output slots per step of the padding loop
ROW_MAX = 16384  # rows up to this many entries are held in registers (`_select_row_kernel`)


@triton.jit
def _row_keys(bits_ptr, valid_ptr, base, j, ok):
    """(key16 + 32768 in 0 .. 65535, validity) of entries j of the row at `base`: the score's order, 0 where
    not valid (a valid score's key16 is at least -32767)."""
    bits = tl.load(bits_ptr + base + j, mask=ok, other=0).to(tl.int32)  # (sign-extended)
    valid = tl.load(valid_ptr + base + j, mask=ok, other=0) != 0
    return tl.where(valid, score_key16(bits) + 32768, 0), valid


@triton.jit
def _fill_unpicked(out_ptr, row, k, count, OUT_BLOCK: tl.constexpr):
    """-1 in the row's output slots `count` .. k-1 (fewer than k valid entries)."""
    for c in range(0, k, OUT_BLOCK):
        p = c + tl.arange(0, OUT_BLOCK)
        tl.store(out_ptr + row * k + p, tl.full([OUT_BLOCK], -1, tl.int64), mask=(p >= count) & (p < k))


@triton.jit
def _select_kernel(bits_ptr, valid_ptr, out_ptr, n, k, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n
    bins = tl.arange(0, 256)
    # how many of the entries whose score key matches `prefix` still belong to the top k
    need = tl.minimum(k, n)
    prefix = tl.full([], 0, tl.int32)  # the k-th best score key's bits decided so far (high byte, then low)
    for r in tl.static_range(2):
        hist = tl.zeros([256], tl.int32)
        for c in range(0, n, BLOCK):
            j = c + tl.arange(0, BLOCK)
            ok = j < n
            u, _ = _row_keys(bits_ptr, valid_ptr, base, j, ok)
            match = ok & ((u >> (16 - 8 * r)) == prefix)  # (round 0: every entry)
            digit = (u >> (8 - 8 * r)) & 255
            # (no histogram mask in every Triton: the others count into bin 0 and are taken out again)
            hist += tl.histogram(tl.where(match, digit, 0), 256)
            hist -= tl.where(bins == 0, tl.sum(tl.where(match, 0, 1)), 0)
        above = tl.sum(hist) - tl.cumsum(hist, 0)  # matching entries whose digit is greater than each bin's
        chosen = tl.max(tl.where((above < need) & (above + hist >= need), bins, -1))
        need -= tl.sum(tl.where(bins == chosen, above, 0))
        prefix = prefix * 256 + chosen
    # `prefix` is the k-th best score key: every entry above it is picked, and of those equal to it the first
    # `need` in index order (ties go to the lower index); written in index order, so ascending
    count = tl.full([], 0, tl.int32)
    equal_seen = tl.full([], 0, tl.int32)
    for c in range(0, n, BLOCK):
        j = c + tl.arange(0, BLOCK)
        ok = j < n
        u, valid = _row_keys(bits_ptr, valid_ptr, base, j, ok)
        equal = (ok & (u == prefix)).to(tl.int32)
        rank = equal_seen + tl.cumsum(equal, 0) - 1  # among the equal entries, in index order
        picked = (ok & valid & ((u > prefix) | ((equal != 0) & (rank < need)))).to(tl.int32)
        slot = count + tl.cumsum(picked, 0) - 1
        tl.store(out_ptr + row * k + slot, j.to(tl.int64), mask=picked != 0)
        count += tl.sum(picked)
        equal_seen += tl.sum(equal)
    _fill_unpicked(out_ptr, row, k, count, OUT_BLOCK)


@triton.jit
def _select_row_kernel(bits_ptr, valid_ptr, out_ptr, n, k, ROW: tl.constexpr, OUT_BLOCK: tl.constexpr):
    # The whole row held in registers (n <= ROW): the k-th best score key by a binary search over its 16 bits
    # (each step one compare and one sum over the row, no histogram atomics, which serialise on the few bins
    # that concentrated scores share), then one pass that picks in index order.
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, ROW)
    ok = j < n
    u, valid = _row_keys(bits_ptr, valid_ptr, row * n, j, ok)
    need = tl.minimum(k, n)
    best = tl.full([], 0, tl.int32)  # the largest key t with at least `need` keys >= t
    for b in tl.static_range(16):
        trial = best | (1 << (15 - b))
        best = tl.where(tl.sum((u >= trial).to(tl.int32)) >= need, trial, best)
    need -= tl.sum((u > best).to(tl.int32))  # of the keys equal to `best`, the first `need` in index order
    equal = (ok & (u == best)).to(tl.int32)
    picked = (ok & valid & ((u > best) | ((equal != 0) & (tl.cumsum(equal, 0) <= need)))).to(tl.int32)
    tl.store(out_ptr + row * k + tl.cumsum(picked, 0) - 1, j.to(tl.int64), mask=picked != 0)
    _fill_unpicked(out_ptr, row, k, tl.sum(picked), OUT_BLOCK)


def topk_indices(
    scores: torch.Tensor,
    valid: torch.Tensor,
    k: int,
    resident: bool | None = None,
    block: int = BLOCK,
    num_warps: int | None = None,
) -> torch.Tensor:
    """The registry's `topk_indices` contract. Rows of at most `ROW_MAX` entries are held in registers
    (`_select_row_kernel`), longer ones streamed in blocks (`_select_kernel`); `resident`, `block` and
    `num_warps` force a launch (for `bench_select_topk.py`)."""
    t, n = scores.shape
    if scores.dtype not in (torch.bfloat16, torch.float16) or valid.dtype != torch.bool or n > 1 << 16:
        raise ValueError(
            f"topk_indices: 16-bit scores and bool valid [T, n <= 65536], got {scores.dtype} "
            f"{tuple(scores.shape)}, {valid.dtype} {tuple(valid.shape)}"
        )
    if k < 1:
        raise ValueError(f"topk_indices: k must be >= 1, got {k}")
    out = torch.empty(t, k, dtype=torch.long, device=scores.device)
    if not (t and n):
        return out.fill_(-1)
    bits, flags = scores.contiguous().view(torch.int16), valid.contiguous().view(torch.uint8)
    if resident if resident is not None else n <= ROW_MAX:
        row = max(16, triton.next_power_of_2(n))
        # 16 entries per thread, at most 16 warps (SM90: a 16k row at 128 registers and a 24-byte stack; 32
        # warps cap the registers at 64 and spill 208 bytes)
        warps = num_warps or max(4, min(16, row // 512))
        _select_row_kernel[(t,)](bits, flags, out, n, k, ROW=row, OUT_BLOCK=OUT_BLOCK, num_warps=warps)
    else:
        _select_kernel[(t,)](
            bits, flags, out, n, k, BLOCK=block, OUT_BLOCK=OUT_BLOCK, num_warps=num_warps or 8
        )
    return out
