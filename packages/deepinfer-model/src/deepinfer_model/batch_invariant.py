"""Batch-invariant mode (`DEEPINFER_BATCH_INVARIANT=1`) of the reference model, on the CPU and on CUDA.

Why the default CPU path is not invariant by construction: blocks accumulate in FP64 and round once
to FP32/BF16, but MKL's FP64 GEMM does not compute a row the same way for every number of rows M (the
M = 1 path is a GEMV, larger M use blocked kernels with other K-unrolling). The FP64 results then
differ in their last bits, and the rounding to FP32 hides that except when a value lies within a few
FP64 ulps of an FP32 rounding boundary (about 2^-28 of values). Rare, but not never.

What the mode changes: every `numerics.linear` / `numerics.logits` (all projections, experts, router,
LM head) and every `matmul` here computes each row independently of the batch. On the CPU (FP64),
`row_gemm` picks a path per row from the row itself: a row of FP32/BF16 values (most GEMM inputs, the
LM head's included) goes through one plain GEMM with the weight as a cached row-major [K, N] operand
(zero columns up to a multiple of `COL_PAD`), where every product is exact and MKL gives the row the
same bits for every M, the M = 1 GEMV included, at any index (measured; see `exact_gemm`), so a decode
row costs a GEMV, not a padded tile; a row with more bits (the SwiGLU output) goes through
fixed tiles of `TILE_ROWS` rows against that weight (`tiled_matmul`). On other devices every row takes
the fixed tiles (the last tile zero-padded), so it goes through the same kernel with the same shape and
K order whatever the batch, the prefill chunk or the prefix-cache hit around it. Costs:
`benchmarks/repro/bench_batch_invariant.py` measures them.

Attention (`sink_attention`): the paged runtime attends per padded group of sequences, so the
default path's FP64 score / softmax / P·V sums see a key count, a column offset and a GEMM shape that
depend on the group (measured: a decode row's FP64 output changed in 261 of 270 group compositions).
In the mode, keys are laid out in tiles of `KEY_TILE` columns aligned to a frame that depends only on
the key itself (absolute position for sliding-window keys, entry index for compressed entries), and
every product is a fixed-shape GEMM ([TILE_ROWS, D] x [D, KEY_TILE] for scores, [TILE_ROWS, KEY_TILE] x
[KEY_TILE, D + 1] for the unnormalised P·V and its row sum). Tile partials are added in tile order, one
tile at a time; a tile a query cannot see contributes exact zeros, so extra padding tiles, in front
(another chunk start) or behind (a wider neighbour), change nothing. Products of a row tile and a key tile that no
row of it sees are not computed at all (`AttentionPlan`, built once per step and key set): the
sliding-window band; where at most `DENSE_FRACTION` of the tiles are seen, the mask / max / exp and
P.V also run on the seen tiles only (gathered); both are bitwise the full computation (tested). The sink is added last. With
FP32-valued q and keys on the CPU (`exact_scores_apply`: keys read from an FP32 or narrower pool, queries
rounded) the scores come from `row_scores` (every product exact, so one keys-as-rows GEMM gives the tile
bits) and no plan is needed: `_one_query_attention` for decode, `_exact_attention_blocks` for chunks
(query blocks against the key tiles they see, P.V on the same fixed tiles); both bitwise the tile path. Operands
are made contiguous first: the GEMM kernel (and its rounding) depends on their layout too (a
transposed view that `reshape` copied for one batch size but not another did change results).
The exp runs on whole tiles (SIMD and scalar-tail exp differ in the last bit). A sparse layer's top-k
selected compressed entries: for a query that sees at most `SHARED_ENTRY_COLS` entries, columns of its
sequence's first entry tiles (shared by the chunk's queries: one read); for a longer context, the query's
own keys, in ascending entry order padded to `own_layout` (`own_order`): scored per query, in the same
softmax as the shared tiles, their P.V partials added after the shared tiles' one own tile at a time (as
shared columns a long-context decode query would score every entry tile, since its selections spread
over nearly all of them). Which layout a query takes depends on its own position only, and its own
list on its selected set only, so neither depends on its neighbours
(`runtime.groups.invariant_selection`).

Not changed (and why it is still invariant): norms, router top-k, quantisation and sampling reduce
within one row; the sampler draws from a keyed stream. The indexer's scores use the same tiled dot
products (`tiled_scores`). Not covered: the stateless `model.forward` keeps the default attention
(its FP64 results may differ from the paged runtime's in the last bits; FP32 logits agreed in every
test), and NVIDIA backend ops that bypass `numerics.linear` (the FP8 linears and grouped experts).

Device-agnostic: everything here allocates on the inputs' device and uses only torch ops (bmm, exp,
max) that exist on every backend. The CPU's bmm is one GEMM per matrix (measured: batch-count
independent). cuBLAS chooses its kernel (tile shape, split-K) from the whole problem, batch count
included, so on other devices every bmm call gets exactly `DEVICE_BATCH` matrices (zero-padded, in
chunks): each call then has one shape, one kernel, and a matrix's result does not depend on which
others share its call. That is the reference (`cpu` table) behaviour of the registry ops `tile_bmm` and
`rows_matmul` which `bmm`, `_products` and `device_rows` call off the CPU; the NVIDIA backend serves them
with Triton kernels (`backends/nvidia/triton_rows.py`) that fix the order per matrix / per row for any
count, so there is no padding and one launch per call (measured on an H200, tiny model, decode through
graphs: the mode's cost fell from +166% to +11.5% at batch 1). Checked on the GPU by the `gpu`-marked
tests in tests/test_repro_*batch_invariant* and packages/deepinfer-model/tests/test_triton_rows.py.
"""

from __future__ import annotations

import contextlib
import copy
import weakref

import numpy as np
import torch
from deepinfer_cluster import envs

ENV = "DEEPINFER_BATCH_INVARIANT"
TILE_ROWS = 8
KEY_TILE = 32  # key columns per attention tile (a multiple of every SIMD width: no scalar tail in exp)
COL_PAD = 16  # weight columns of `row_gemm` padded to a multiple of this (an odd N changed row bits)
DEVICE_BATCH = 16  # matrices per bmm call off the CPU (one problem shape -> one cuBLAS kernel)
DENSE_FRACTION = 0.5  # attention plans seeing more of their tiles than this take the dense layout
SCORE_COLS = 4  # `row_scores`: query rows (GEMM columns) padded to a multiple of this (odd counts differ)
GATHER_CHUNK = 4096  # gathered tile products per bmm call in attention (bounds the gathered copies)
EXACT_BLOCK_QUERIES = 64  # queries per block of `_exact_attention_blocks` (each scores its band of key tiles)
PV_HALF_ROWS = 4  # `_one_query_attention`: P.V tile rows for at most this many heads (CPU, see there)
# CPU GEMMs of exact products (`_cpu_gemm`) run over K in blocks of at most GEMM_K_BLOCK columns, their
# results added in block order, and with more than one intra-op thread with at least MIN_GEMM_ROWS rows
# (zero rows appended): MKL's FP64 kernels split a longer K at points that depend on M, and its threaded
# GEMV splits one row's work. Measured on an AVX-512 host (torch 2.15): FP32-valued rows with K >= 512
# differed in their last bits between M = 1..2 and more rows, with K >= 1024 and N >= 256 between M < ~192
# and more, and with 2 threads M = 1 differed from M > 1 already at K = 129; 256-column blocks agreed for
# every M up to 700 (K up to 4096, N up to 16,160) with 1 thread, and from 3 rows on with 2 threads (the
# host of earlier sessions agreed for every M at any K). One thread keeps a decode row's GEMV.
GEMM_K_BLOCK = 256
MIN_GEMM_ROWS = 4
# Wide weights (`row_gemm`, e.g. the LM head): MKL's row-major "NN" FP64 GEMM of a few rows against a
# weight larger than the caches ran ~1.5x slower than the "NT" GEMM against the weight as stored [N, K]
# that the default mode runs (measured, 1 thread, K = 128, N = 129,280: 8 rows 39.5 vs 26.4 ms; for
# weights under ~16 MiB and from ~64 rows on NN was as fast or faster). The two layouts give the same
# bits when both run over K blocks of at most WIDE_K_BLOCK columns and NT gets a multiple of
# NT_ROW_MULTIPLE rows (zero rows appended; measured on the AVX-512 host: M = 1..300, K up to 1024, N up
# to 129,280, 1 and 2 threads; with 256-column blocks they differed from K = 200 on for narrow N, and
# NT's own GEMV for M = 1 sums in another order). So weights of at least WIDE_BYTES (FP64) keep a second
# cached copy in the stored layout (twice the memory for those weights), and NT_ROWS rows take it.
WIDE_BYTES = 16 << 20
WIDE_K_BLOCK = 128
NT_ROWS = range(4, 33)
NT_ROW_MULTIPLE = 4


# The setting for the model step that is running (`numerics.resolved`), None outside one.
_PINNED: bool | None = None
# Within `sync_free()` (the graph-safe decode step): the CPU paths below take no data-dependent branch
# (no host read), computing both sides where the eager step picks one from the values.
_SYNC_FREE = False


@contextlib.contextmanager
def sync_free():
    """Within the block, the CPU row paths (`row_gemm`, `exact_gemm`, `grouped_gemm`) make no host read:
    where the eager path tests the values to skip work (rows with more than FP32's bits, lo parts that are
    zero), they compute every candidate and pick per row with `torch.where`, which gives each row the bits
    of the branch the eager path takes (each row's result depends on that row only). The graph-safe decode
    step runs in it (`no_host_sync` proves it on the CPU)."""
    global _SYNC_FREE
    outer, _SYNC_FREE = _SYNC_FREE, True
    try:
        yield
    finally:
        _SYNC_FREE = outer


def enabled() -> bool:
    """Whether the mode is on: within a model step (`numerics.resolved`, which the paged runner enters
    once per step) the value read at its start, otherwise read from the environment at every call, so
    tests and benchmarks may flip it between steps."""
    pinned = _PINNED
    return read_env() if pinned is None else pinned


def read_env() -> bool:
    """`DEEPINFER_BATCH_INVARIANT` as set now (a boolean of `deepinfer_cluster.envs`; unset: off)."""
    return envs.get(ENV)


# One zero scalar per (device, dtype): padding is its stride-0 expansion, which `torch.cat` reads, so a
# zero-padded operand costs one kernel (the cat) instead of two (a fill, then the cat). On a GPU the
# batch-invariant step is launch-bound and pads many small operands (measured on an H200, tiny model:
# 453 fills and 415 cats in one graphed decode step).
_ZERO: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _zero(x: torch.Tensor) -> torch.Tensor:
    key = (x.device, x.dtype)
    zero = _ZERO.get(key)
    if zero is None:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        # made during a CUDA-graph capture it would live in the graph's pool: keep only ones made outside
        if not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ZERO[key] = zero
    return zero


def _pad0(x: torch.Tensor, pad: int, dim: int = 0) -> torch.Tensor:
    """`x` with `pad` zero slices appended along `dim` (itself when pad is 0), in one kernel."""
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat((x, _zero(x).expand(shape)), dim)


def bmm(a: torch.Tensor, b: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """torch.bmm whose per-matrix results do not depend on the batch count on any device (see above): on
    the CPU torch.bmm itself; elsewhere the backend's `tile_bmm` op (NVIDIA: one Triton kernel for any
    count; the reference: calls of exactly `DEVICE_BATCH` matrices, the last one zero-padded); with an
    explicit `chunk`, calls of exactly `chunk` matrices on any device."""
    if chunk is None:
        if a.device.type == "cpu":
            return torch.bmm(a, b)
        return _device_ops().tile_bmm(a, b, None, None)
    return chunked_bmm(a, b, chunk)


def chunked_bmm(a: torch.Tensor, b: torch.Tensor, chunk: int = DEVICE_BATCH) -> torch.Tensor:
    """torch.bmm in calls of exactly `chunk` matrices (the last one zero-padded): one problem shape per
    call, so one cuBLAS kernel, and a matrix's result does not depend on which others share its call."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n = a.shape[0]
    if n == 0:  # e.g. the LM head of a step with no logits rows: nothing to tile
        return a.new_empty(0, a.shape[1], b.shape[2])
    pad = (-n) % chunk
    shared = b.stride(0) == 0  # one broadcast matrix (a weight): stays a stride-0 view, never copied
    # one memory layout for every call (a strided view and its padded copy would differ)
    a = _pad0(a.contiguous(), pad)
    b = b[:1].expand(chunk, *b.shape[1:]) if shared else _pad0(b.contiguous(), pad)
    if n + pad == chunk:  # one call: its output is the result (no concatenation)
        return torch.bmm(a, b)[:n]
    out = [torch.bmm(a[i : i + chunk], b if shared else b[i : i + chunk]) for i in range(0, n + pad, chunk)]
    return torch.cat(out)[:n]


def gathered_chunked_bmm(
    a: torch.Tensor, b: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor
) -> torch.Tensor:
    """a[ia[j]] @ b[ib[j]] for every j as `bmm` calls of gathered (contiguous) matrices, at most
    `GATHER_CHUNK` per call (memory): the reference `tile_bmm` with indices."""
    out = []
    for c in range(0, len(ia), GATHER_CHUNK):
        out.append(bmm(a[ia[c : c + GATHER_CHUNK]], b[ib[c : c + GATHER_CHUNK]]))
    return torch.cat(out) if len(out) != 1 else out[0]


_GET_OPS = None  # `ops.registry.get_ops`, imported at first use (the registry loads the backends, which
# import this module); kept, since an import statement per op call is host time the eager step pays


def _device_ops():
    global _GET_OPS
    if _GET_OPS is None:
        from .ops.registry import get_ops

        _GET_OPS = get_ops
    return _GET_OPS()


def tiled_matmul(x: torch.Tensor, w_t: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """`x @ w_t` for 2-D `x` [M, K], computed as fixed [TILE_ROWS, K] @ [K, N] products (one bmm of
    `chunk` tiles per call, as `bmm`). The path for accelerators (and for CPU dtypes other than FP64).
    With chunks (off the CPU) the rows are padded at once to whole chunks of tiles (the zero tiles `bmm`
    would append): one copy of `x`."""
    if chunk is None and x.device.type != "cpu":
        chunk = DEVICE_BATCH
    m, k = x.shape
    x = _pad0(x, (-m) % (TILE_ROWS * (chunk or 1)))
    tiles = x.reshape(-1, TILE_ROWS, k)
    # bmm runs one GEMM per tile (the weight is broadcast, not copied); a 3-D @ 2-D matmul would be
    # folded back into one [M, K] GEMM, which is exactly what must not happen.
    out = bmm(tiles, w_t.unsqueeze(0).expand(tiles.shape[0], -1, -1), chunk)
    return out.reshape(-1, w_t.shape[1])[:m]


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


def _fp32_valued(t: torch.Tensor) -> bool:
    """Every value of `t` has at most FP32's 24-bit significand (FP32 and BF16 values do)."""
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return True
    return bool(torch.equal(t.float().to(t.dtype), t))


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


def _cpu_gemm(a: torch.Tensor, b: torch.Tensor, b_nt: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b` (2-D, or 3-D as a bmm) on the CPU as GEMMs over K blocks of `GEMM_K_BLOCK` columns, summed in
    block order, of at least `MIN_GEMM_ROWS` rows where torch runs several threads: each block's sum then has
    one order for every M (see `GEMM_K_BLOCK`).

    `b_nt` (2-D only): the same weight as a contiguous [N, K] copy (a wide weight, see `WIDE_BYTES`). Then
    the blocks are `WIDE_K_BLOCK` columns, and `NT_ROWS` rows multiply `b_nt` transposed, padded to a
    multiple of `NT_ROW_MULTIPLE` rows: the same bits as `b`, faster."""
    mm = torch.mm if a.dim() == 2 else torch.bmm
    m, k = a.shape[-2], a.shape[-1]
    k_block = GEMM_K_BLOCK if b_nt is None else WIDE_K_BLOCK
    if b_nt is not None and m in NT_ROWS:
        a = _pad0(a, (-m) % NT_ROW_MULTIPLE)

        def block(lo: int, hi: int) -> torch.Tensor:
            return torch.mm(a[:, lo:hi], b_nt[:, lo:hi].t())
    else:
        a = _pad0(
            a, MIN_GEMM_ROWS - m if torch.get_num_threads() > 1 and m < MIN_GEMM_ROWS else 0, a.dim() - 2
        )

        def block(lo: int, hi: int) -> torch.Tensor:
            return mm(a[..., lo:hi], b[..., lo:hi, :])

    out = block(0, k_block)
    for k0 in range(k_block, k, k_block):
        out += block(k0, k0 + k_block)
    return out if out.shape[-2] == m else out[..., :m, :]


def exact_gemm(a: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """`a @ sum(parts)` on the CPU (2-D, or 3-D as a bmm) for FP64 `a` and FP64 `parts` of at most 24
    significant bits each (contiguous, last dim a multiple of `COL_PAD`), with every product exact.

    Why: MKL's FP64 kernels sum over K in the same order for every M (measured: operands whose products
    are exact gave bitwise equal rows for M = 1..2048 at any row offset, K up to 7168, 1 and 2 threads,
    on one host; on an AVX-512 host only over K blocks of at most `GEMM_K_BLOCK` columns and, with several
    threads, from `MIN_GEMM_ROWS` rows on, which `_cpu_gemm` therefore runs), but rows in full register
    blocks and the other rows (the GEMV of M = 1, a tail of M mod 4 rows) differ in fused vs separate
    multiply-add: with inexact products a row's bits then depend on M and on its index. A product of a 24-bit and a 29-bit significand fits FP64's 53 bits, so `a` is
    split into hi = `a` rounded to FP32 and lo = a - hi (exact, at most 29 significant bits; `a` within
    FP32's normal range). The result is the sum over parts of hi @ part, then of lo @ part for the rows
    whose lo is not zero (decided per row from the row itself, so a row of FP32 values never sees those
    terms, not even as a +0 that would turn a -0 into +0). Activations are FP32/BF16-valued at most
    GEMM inputs: one GEMM per weight part there."""
    a = a.contiguous()
    hi = a.float().double()
    lo = a - hi
    out = _cpu_gemm(hi, parts[0])
    for p in parts[1:]:
        out = out + _cpu_gemm(hi, p)
    if _SYNC_FREE or bool(lo.any()):  # (one cheap test first: most GEMM inputs are FP32/BF16 values)
        has_lo = lo.ne(0).any(dim=-1, keepdim=True)
        low = _cpu_gemm(lo, parts[0])
        for p in parts[1:]:
            low = low + _cpu_gemm(lo, p)
        out = torch.where(has_lo, out + low, out)
    return out


def row_gemm(x: torch.Tensor, w_t: torch.Tensor, fp32_valued: bool = False) -> torch.Tensor:
    """`x @ w_t` (`w_t` widened to FP64) for 2-D FP64 `x` [M, K] on the CPU, each row's result independent
    of M and of the other rows. Chosen per row from the row itself (so a row takes the same path in
    every batch): a row of FP32 values goes through one GEMM with the weight as a row-major [K, N]
    operand (MKL's "NN" kernel, which keeps its K order for every M, and with FP32-valued weights every
    product exact, see `exact_gemm`; zero columns up to a multiple of `COL_PAD`: an odd N, a scalar
    column tail, changed row bits too); a row with more bits (e.g. the SwiGLU output) goes through the
    fixed 8-row tiles of `tiled_matmul`, cheaper than `exact_gemm`'s second GEMM for it. Weights that
    are not FP32-valued take `exact_gemm` (split in parts) for every row. A wide weight (the LM head)
    gives 4..32 FP32-valued rows to the faster NT GEMM, with the same bits (see `WIDE_BYTES`)."""
    m, n = x.shape[0], w_t.shape[1]
    if m == 0:
        return x.new_empty(0, n)
    parts, nt = _row_major(w_t)
    x = x.contiguous()
    if len(parts) > 1:
        out = exact_gemm(x, parts)
        return out if out.shape[1] == n else out[:, :n]
    if fp32_valued:  # the caller knows every row is FP32-valued (`marked_fp32_valued`): no test
        out = _cpu_gemm(x, parts[0], nt)
        return out if out.shape[1] == n else out[:, :n]
    fp32 = x.float().double()
    if _SYNC_FREE:  # both paths for every row, each row takes its own (see `sync_free`)
        wide = x.ne(fp32).any(dim=-1, keepdim=True)
        return torch.where(wide, tiled_matmul(x, parts[0]), _cpu_gemm(x, parts[0], nt))[:, :n]
    if torch.equal(x, fp32):  # every row FP32-valued (the common case: one test, one host read)
        out = _cpu_gemm(x, parts[0], nt)
        return out if out.shape[1] == n else out[:, :n]
    wide = x.ne(fp32).any(dim=-1)  # rows with more than FP32's 24 significant bits (NaN rows too)
    if bool(wide.all()):
        return tiled_matmul(x, parts[0])[:, :n]
    out = x.new_empty(m, n)
    short = ~wide
    out[short] = _cpu_gemm(x[short], parts[0], nt)[:, :n]
    out[wide] = tiled_matmul(x[wide], parts[0])[:, :n]
    return out


# Row-major FP64 copies of stacked weights for `grouped_gemm`: stacks [E, N_i, K] (or one [N, K] weight)
# concatenated along N, keyed by the ids of the source tensors, guarded by weak references and their
# in-place version counters (as `_ROW_MAJOR`); None where they are not FP32-valued or over the budget.
_STACKS: dict[tuple[int, ...], tuple[tuple, tuple[int, ...], torch.Tensor | None]] = {}
LOOP_ROWS = 32  # rows per non-empty group above which `grouped_gemm` takes one call per group
LOOP_GROUPS = 16  # non-empty groups up to which `grouped_gemm` takes one call per group at any row count
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


def grouped_gemm(
    x: torch.Tensor,
    counts: list[int],
    parts: torch.Tensor,
    loop: bool | None = None,
    fp32_valued: bool = False,
) -> torch.Tensor:
    """Rows of FP64 `x` [R, K] (on the CPU) sorted by group, `counts[e]` rows for group e, times group e's
    weight `parts[e]` ([E, K, N] from `stacked_parts`) -> FP64 [R, N], each row's result independent
    of every other row, of the group sizes and of M.

    Why it is invariant: every product is exact (as in `exact_gemm`: a row is split into hi = its FP32
    rounding and lo = the rest, at most 29 significant bits, against weights of at most 24), and MKL's
    FP64 GEMM sums exact products in the same K order for every M (over K blocks of `GEMM_K_BLOCK`, see
    `_cpu_gemm`) and every row index, in `torch.bmm` as in `torch.mm` (measured, and tested:
    `test_grouped_gemm_rows_do_not_depend_on_the_batch`). So
    all groups go into one bmm over [E', Mmax, K] (groups zero-padded to the longest; E' = the groups
    from the first to the last non-empty one, which are views of `parts`), instead of one call or one
    set of fixed row tiles per group. A row whose lo is not zero (decided from the row itself: the
    SwiGLU output of the down projection) adds the product of its lo, computed as one more row of its
    group; an FP32-valued row never sees that term (not even as +0, which would turn a -0 into +0).

    Groups of more than `LOOP_ROWS` rows on average (prefill), or at most `LOOP_GROUPS` non-empty groups
    (a shared expert, the tiny model's 8 experts), instead take one `torch.mm` per group on its
    contiguous hi rows (and one on its lo rows): the padding, scatter and gather of the single call
    cost more there than the calls (measured at decode, 8 experts, 16 rows: 80 vs 120 us for gate/up,
    140 vs 180 us for the down projection, 42 vs 129 us for a shared expert's). The same bits either
    way (`loop` forces one; tested).

    `fp32_valued`: the caller knows every row is FP32-valued (`marked_fp32_valued`): no lo terms, and
    equal groups (the attention's grouped output projection) are one bmm of the rows as they are."""
    r, k = x.shape
    n = parts.shape[2]
    if r == 0:
        return x.new_empty(0, n)
    if sum(counts) != r or len(counts) != parts.shape[0]:
        raise ValueError(f"grouped_gemm: counts {counts} do not describe {r} rows of {parts.shape[0]} groups")
    x = x.contiguous()
    if fp32_valued and not loop and len(set(counts)) == 1 and k * n * counts[0] >= GEMM_NAIVE_ELEMENTS:
        return _cpu_gemm(x.view(len(counts), counts[0], k), parts).reshape(r, n)
    # FP32-valued rows (known, or found here) have no lo part
    hi, lo = (x, None) if fp32_valued else (x.float().double(), None)
    if not fp32_valued:
        lo = x - hi
    used_groups = sum(1 for c in counts if c)
    if _SYNC_FREE or (
        loop if loop is not None else used_groups <= LOOP_GROUPS or r > LOOP_ROWS * used_groups
    ):
        return _grouped_loop(hi, lo, counts, parts)
    if lo is None:
        wide = torch.zeros(0, dtype=torch.long)
    else:
        wide = torch.nonzero(lo.ne(0).any(dim=1)).flatten()  # rows with more bits (NaN rows too: lo is NaN)
    # the rows' slots in the padded [E', Mmax] layout, on the host (the counts are host values)
    cnt = np.asarray(counts, dtype=np.int64)
    group = np.repeat(np.arange(len(cnt)), cnt)
    total = cnt.copy()
    if len(wide):  # each wide row's lo goes in its group after the group's rows, in row order
        wg = group[wide.numpy()]
        n_wide = np.bincount(wg, minlength=len(cnt))
        lo_slot = cnt[wg] + np.arange(len(wg)) - (np.cumsum(n_wide) - n_wide)[wg]
        total += n_wide
    used = np.flatnonzero(cnt)
    first, last = int(used[0]), int(used[-1]) + 1
    mmax = int(total.max())
    if k * n * mmax < GEMM_NAIVE_ELEMENTS:
        raise ValueError(
            f"grouped_gemm: K * N = {k * n} is below GEMM_NAIVE_ELEMENTS = {GEMM_NAIVE_ELEMENTS}"
        )
    w = parts[first:last]  # a view: the groups in range, empty ones included (their rows are zeros)
    if not len(wide) and bool((cnt[first:last] == mmax).all()):  # every group full: no padding needed
        return _cpu_gemm(hi.view(last - first, mmax, k), w).reshape(r, n)
    dest = torch.from_numpy((group - first) * mmax + np.arange(r) - (np.cumsum(cnt) - cnt)[group])
    a = x.new_zeros((last - first) * mmax, k)
    a[dest] = hi
    if len(wide):
        lo_dest = torch.from_numpy((wg - first) * mmax + lo_slot)
        a[lo_dest] = lo[wide]
    prod = _cpu_gemm(a.view(last - first, mmax, k), w).reshape(-1, n)
    out = prod[dest]
    if len(wide):
        out[wide] = out[wide] + prod[lo_dest]
    return out


def _grouped_loop(
    hi: torch.Tensor, lo: torch.Tensor | None, counts: list[int], parts: torch.Tensor
) -> torch.Tensor:
    """`grouped_gemm` as one mm per non-empty group of its hi rows against `parts[e]` and, where some row
    has a lo part (None: no row has), one more per group of its lo rows; a row adds its lo product only
    if its own lo is not zero. Separate calls give each row the bits of one call of [hi; lo] rows (a
    row's exact-product GEMM result does not depend on M or on its index, see `exact_gemm`), without
    copying them into one operand."""

    def products(rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], parts.shape[2])
        start = 0
        for e, c in enumerate(counts):
            if c:
                out[start : start + c] = _cpu_gemm(rows[start : start + c], parts[e])
                start += c
        return out

    out = products(hi)
    if lo is None:
        return out
    has_lo = lo.ne(0).any(dim=1, keepdim=True)  # (NaN rows too: lo is NaN)
    if _SYNC_FREE:  # (see `sync_free`: the same bits as either branch below, per row)
        return torch.where(has_lo, out + products(lo), out)
    if not bool(has_lo.any()):
        return out
    if bool(has_lo.all()):  # (the SwiGLU output: every row has more than 24 significant bits)
        return out + products(lo)
    return torch.where(has_lo, out + products(lo), out)


def matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """`x @ w_t` over the last dim of `x` (any leading dims); row-invariant when the mode is on."""
    if not enabled():
        return x @ w_t
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.device.type == "cpu" and flat.dtype == torch.float64 and w_t.dtype == torch.float64:
        out = row_gemm(flat, w_t, marked_fp32_valued(x))
    elif flat.device.type == "cpu":
        out = tiled_matmul(flat, w_t)
    else:
        out = device_rows(flat, w_t.t())
    return out.reshape(*lead, w_t.shape[1])


def device_rows(x: torch.Tensor, weight: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    """The mode's `x @ weight.T` off the CPU for 2-D `x` (FP64 or FP32) and a weight [N, K] as stored: the
    `rows_matmul` op of the device's backend (the reference: `tiled_matmul` against the weight widened to
    `x.dtype`; NVIDIA: a Triton kernel that costs one row of work per row, no padded tiles), its output
    rounded to `round_to` (FP32 / BF16 / FP16, or None) in x.dtype."""
    return _device_ops().rows_matmul(x, weight, round_to)


# ------------------------------------------------------------------------------------------ attention
def key_tiles(n: int) -> int:
    """Columns of a key segment of `n` keys rounded up to whole tiles (at least one tile)."""
    return max(-(-int(n) // KEY_TILE), 1) * KEY_TILE


def aligned_span(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, int]:
    """(start [G], width) of key columns for key positions [lo, hi) per sequence: each start aligned
    down to a multiple of `KEY_TILE` (so column c of tile t always holds the same absolute position),
    one width, in whole tiles, that covers every sequence."""
    lo = np.asarray(lo, dtype=np.int64)
    start = lo - lo % KEY_TILE
    return start, key_tiles(int((np.asarray(hi) - start).max()))


# on the CPU, a top-k selected entry of a query that sees at most this many compressed entries is a column
# of its sequence's first entry tiles, else one of the query's own keys (`runtime.groups.invariant_selection`)
SHARED_ENTRY_COLS = 2 * KEY_TILE


def shared_entry_cols(device: torch.device) -> int:
    """The `SHARED_ENTRY_COLS` threshold on `device`: on the CPU the constant (own keys copy k entries per
    query of a prefill chunk: +17.5% vs +13% per batch-8 prefill step); elsewhere 0, every query takes own
    keys: a GPU copies them at memory speed, and the graph-safe decode step, which cannot skip a layout,
    would compute both for every row (measured on the H200: graphed decode +10% / +12% at batch 1 / 8 with
    own keys only, +17% / +19% with both). Bits are compared on one device, so each may lay them out its
    own way."""
    return SHARED_ENTRY_COLS if torch.device(device).type == "cpu" else 0


OWN_COLS = 8  # a query's own (top-k selected) key list is padded to a multiple of this many columns


def own_layout(k: int) -> tuple[int, int]:
    """(tile columns, total columns) of a query's own key list for a top-k of `k` entries: `k` rounded up
    to a multiple of `OWN_COLS`, in tiles of at most `KEY_TILE` columns (whole tiles)."""
    width = -(-max(int(k), 1) // OWN_COLS) * OWN_COLS
    tile = min(KEY_TILE, width)
    return tile, -(-width // tile) * tile


def own_order(selected: torch.Tensor) -> torch.Tensor:
    """Top-k selections [R, k] (entry ids, -1 = none) -> [R, `own_layout(k)[1]`]: each row's entries in
    ascending order, then -1 (none) to the full width. The column of a selected entry in its query's own
    key list: a function of the selected set only (the order `select_topk` returned does not matter)."""
    k = selected.shape[-1]
    width = own_layout(k)[1]
    big = torch.iinfo(selected.dtype).max
    out = torch.sort(torch.where(selected < 0, big, selected), dim=-1).values
    out = torch.where(out == big, -1, out)
    if width > k:
        out = torch.cat((out, out.new_full((*out.shape[:-1], width - k), -1)), dim=-1)
    return out


def _own_scores(q: torch.Tensor, own: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """Scaled scores of every query [B, M, nh, D] against its own keys (own = (keys [B, M, Ko, D], visible
    bool [B, M, Ko])): FP64 [B, M, nh, Ko], -inf where not visible. One [nh, D] x [D, Ko] product per query
    (`bmm`: its bits do not depend on how many queries share the call), the same in every path."""
    keys, vis = own
    b, m, nh, d = q.shape
    ko = keys.shape[2]
    kt = keys.double().reshape(b * m, ko, d).transpose(1, 2).contiguous()  # [B*M, D, Ko]
    sc = bmm(q.double().reshape(b * m, nh, d).contiguous(), kt).view(b, m, nh, ko) * scale
    return sc.masked_fill_(~vis[:, :, None, :], float("-inf"))


def _own_partials(scores: torch.Tensor, mx: torch.Tensor, own: tuple[torch.Tensor, torch.Tensor]):
    """Unnormalised P.[K | 1] of every query's own keys, per own tile: exp(scores - mx) (mx [B, M, nh], each
    row's max over all its keys and the sink; the exp on whole tiles, see `_whole_exp`) times the tile's
    [K | 1], one [nh, tile] x [tile, D + 1] product per (query, own tile) -> FP64 [B, M, To, nh, D + 1]."""
    keys, vis = own
    b, m, nh, ko = scores.shape
    d = keys.shape[-1]
    tile = min(KEY_TILE, ko)
    to = ko // tile
    e = _whole_exp((scores - mx[..., None]).nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0))
    e = e.mul_(vis[:, :, None, :].double())  # (masked entries: exp(0) * 0, see `_masked_exp`)
    pt = e.view(b * m, nh, to, tile).transpose(1, 2).contiguous().view(-1, nh, tile)
    vals = torch.cat((keys.double(), keys.new_ones((b, m, ko, 1), dtype=torch.float64)), dim=-1)
    return bmm(pt, vals.view(-1, tile, d + 1)).view(b, m, to, nh, d + 1)


def _whole_exp(x: torch.Tensor) -> torch.Tensor:
    """exp of a contiguous tensor computed as a flat vector whose length is a multiple of `KEY_TILE`
    (zero-padded when it is not): every element takes the vector exp, never a scalar tail."""
    n = x.numel()
    if n % KEY_TILE == 0:
        return torch.exp(x)
    flat = x.new_zeros(n + (-n) % KEY_TILE)
    flat[:n] = x.reshape(-1)
    return torch.exp(flat)[:n].view(x.shape)


def _with_own(acc: torch.Tensor, part: torch.Tensor | None) -> torch.Tensor:
    """acc [B, M, nh, D + 1] (a row's shared-tile partials summed in tile order) plus its own tiles'
    partials `part` [B, M, To, nh, D + 1] added after them, one tile at a time in own tile order."""
    if part is not None:
        for t in range(part.shape[2]):
            acc = acc + part[:, :, t]
    return acc


def _own_max(mx: torch.Tensor, own_scores: torch.Tensor | None) -> torch.Tensor:
    """mx [B, M, nh] (max over the shared keys and the sink) with the own keys' max included."""
    return mx if own_scores is None else torch.maximum(mx, own_scores.amax(dim=-1))


def _row_tiles(x: torch.Tensor) -> torch.Tensor:
    """[B, R, C] -> [B, ceil(R / TILE_ROWS), TILE_ROWS, C] (zero rows appended)."""
    b, r, c = x.shape
    return _pad0(x, (-r) % TILE_ROWS, dim=1).view(b, -1, TILE_ROWS, c)


def _tile_products(
    a: torch.Tensor, b: torch.Tensor, seen: np.ndarray | None = None, batched: bool | None = None
) -> torch.Tensor:
    """All products a[i, r, t] @ b[i, t]: a [B, R, Ta, m, k] (Ta = T, or 1 = the same for every t),
    b [B, T, k, n] -> [B, R, T, m, n]. Every product is one [m, k] x [k, n] GEMM of contiguous
    matrices; calls loop over (the smaller of B and R) x T and batch the larger, with the shared
    operand broadcast (never copied). A product does not depend on how it was batched (tested).

    `seen` (bool [B, R, T] on the host, optional): which products can matter. Per call only the
    contiguous hull of the batched index where `seen` holds is computed; the rest stay exact +0, which
    is also what a GEMM gives for them (an all-zero P tile times any keys: every product is ±0, summed
    from +0 -> +0; a masked score is replaced by -inf anyway), so skipping them changes no bit. This is
    the band restriction of the sliding window: a query row tile computes only the key tiles it sees.

    `batched` (default: off the CPU, where the step is launch-bound): every product, `seen` or not, goes
    into one gathered product list (`_tile_products_batched`) instead of one call per tile; an unseen
    product is masked to -inf (scores) or is the +0 of an all-zero P tile (P.V), so computing it changes
    no bit; every product is still one fixed [m, k] x [k, n] GEMM."""
    if batched is None:
        batched = a.device.type != "cpu"
    if batched:  # every product, `seen` or not: an unseen one is masked (scores) or +0 (P.V) anyway
        return _tile_products_batched(a, b)
    bsz, r_count, ta = a.shape[:3]
    t_count = b.shape[1]
    alloc = a.new_empty if seen is None else a.new_zeros
    out = alloc(bsz, r_count, t_count, a.shape[-2], b.shape[-1])
    for t in range(t_count):
        at = min(t, ta - 1)
        if r_count >= bsz:
            for i in range(bsz):
                lo, hi = _hull(None if seen is None else seen[i, :, t], r_count)
                if hi > lo:
                    out[i, lo:hi, t] = bmm(a[i, lo:hi, at], b[i, t].expand(hi - lo, -1, -1))
        else:
            for r in range(r_count):
                lo, hi = _hull(None if seen is None else seen[:, r, t], bsz)
                if hi > lo:
                    out[lo:hi, r, t] = bmm(a[lo:hi, r, at], b[lo:hi, t])
    return out


def _tile_products_batched(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every product of `_tile_products` (same shapes, same results) as one gathered product list
    (`_products`): product (i, r, t) = a[i, r, min(t, Ta - 1)] @ b[i, t], indexed into the flat operands
    (no expanded copies where the backend gathers in its kernel)."""
    bsz, r_count, ta, m, k = a.shape
    t_count, n = b.shape[1], b.shape[-1]
    ia, ib = _product_indices(bsz, r_count, ta, t_count, a.device)
    out = _products(a.reshape(-1, m, k), b.reshape(-1, k, n), ia, ib)
    return out.view(bsz, r_count, t_count, m, n)


# (B, R, Ta, T, device) -> the index tensors of `_tile_products_batched`: functions of the shapes only, made
# once on the host (a decode step would otherwise launch ~8 small kernels per call to build them). Inside a
# CUDA-graph capture nothing is copied from the host: a cached entry (the warm-up run before a capture
# fills the cache for its shapes) is moved to `_CAPTURED_INDICES`, which is never evicted (the graph reads
# that memory at every replay); a missing one is made on the device, in the graph's own pool.
_PRODUCT_INDICES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_CAPTURED_INDICES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
PRODUCT_INDEX_CACHE = 512  # entries of `_PRODUCT_INDICES` before it is emptied (prefill shapes vary)


def _product_indices(bsz: int, r_count: int, ta: int, t_count: int, dev: torch.device):
    key = (bsz, r_count, ta, t_count, dev)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    hit = _CAPTURED_INDICES.get(key) or _PRODUCT_INDICES.get(key)
    if hit is not None:
        if capturing:
            _CAPTURED_INDICES[key] = hit
        return hit
    xp = (lambda n: torch.arange(n, device=dev)) if capturing else np.arange
    i, r, t = xp(bsz), xp(r_count), xp(t_count)
    t_a = t.clip(max=ta - 1) if capturing else np.minimum(t, ta - 1)
    ia = ((i[:, None, None] * r_count + r[None, :, None]) * ta + t_a[None, None, :]).reshape(-1)
    ib = (i[:, None, None] * t_count + t[None, None, :] + 0 * r[None, :, None]).reshape(-1)
    if capturing:
        return ia, ib
    out = (torch.from_numpy(ia).to(dev), torch.from_numpy(ib).to(dev))
    if len(_PRODUCT_INDICES) >= PRODUCT_INDEX_CACHE:
        _PRODUCT_INDICES.clear()
    _PRODUCT_INDICES[key] = out
    return out


def _hull(flags: np.ndarray | None, n: int) -> tuple[int, int]:
    """[first, last + 1) of the true `flags` (all `n` when None; empty when none is true)."""
    if flags is None:
        return 0, n
    idx = np.flatnonzero(flags)
    return (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)


def version_of(t: torch.Tensor) -> int | None:
    """`t`'s in-place version counter, or None for an inference tensor (made under `torch.inference_mode`,
    which keeps none: reading `_version` raises): caches and marks guarded by it skip such tensors."""
    if torch.compiler.is_compiling():  # a traced step cannot read versions: it keeps no marks or caches
        return None
    return None if t.is_inference() else t._version


# Key tensors known to hold FP32-valued entries (read from an FP32 / BF16 / FP8 cache pool), marked by
# the paged runtime where it reads them: checking every element costs as much as the fast paths save.
_FP32_MARK = "_deepinfer_fp32_valued"


def mark_fp32_valued(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` (returned) as holding only FP32-valued entries: the caller knows (e.g. it was read from an
    FP32 or narrower cache pool, or rounded to FP32 / BF16 by `numerics.round_to`). Derived tensors are
    not marked. The mark holds the tensor's in-place version: an in-place change afterwards (which may
    write other values) voids it. Inference tensors (made under `torch.inference_mode`) keep no version,
    so they are left unmarked (their values get tested where it matters)."""
    version = version_of(t)
    if version is not None:
        setattr(t, _FP32_MARK, version)
    return t


def marked_fp32_valued(t: torch.Tensor) -> bool:
    """Whether `t` itself was marked by `mark_fp32_valued` and not changed in place since."""
    mark = getattr(t, _FP32_MARK, None)
    return mark is not None and mark == version_of(t)


def exact_scores_apply(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `row_scores` may replace `tiled_scores` for q . keys: on the CPU, FP64, `keys` marked
    FP32-valued and every value of `q` (small: checked here) FP32-valued."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float64
        and keys.dtype == torch.float64
        and marked_fp32_valued(keys)
        and (marked_fp32_valued(q) or _fp32_valued(q))
    )


def row_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`tiled_scores(q, keys)` bit for bit, for FP32-valued q [B, R, D] and keys [B, S, D] on the CPU
    (`exact_scores_apply`), as one NN bmm keys [S, D] @ q^T [D, R] per sequence: no padded row tiles, no
    transposed key copy.

    Why it is the same: a product of two FP32 values (24 significant bits each) is exact in FP64, and MKL's
    FP64 GEMM sums exact products over K in one order whatever M and N are when both operands are
    contiguous row-major (measured: [8, D] x [D, 32] tiles, [R, D] x [D, S] and [S, D] x [D, R] agree
    bitwise for every even R = 2..64 and up to 1000, S = 32..1024, D = 64..576, 1 and 2 threads; an odd R,
    a scalar column tail, and transposed operand layouts do not), so a (row, key) score is the same
    function of the two vectors in either shape (tested: `test_row_scores_equal_the_tiled_scores`).
    q's rows are therefore zero-padded to a multiple of `SCORE_COLS` columns."""
    if keys.shape[1] % KEY_TILE:
        raise ValueError(f"keys.shape[1] = {keys.shape[1]} must be a multiple of KEY_TILE = {KEY_TILE}")
    b, r, d = q.shape
    pad = (-r) % SCORE_COLS
    q_t = q.new_zeros(b, d, r + pad)
    q_t[:, :, :r] = q.transpose(1, 2)
    out = torch.bmm(keys.contiguous(), q_t)  # [B, S, R + pad]
    return (out if not pad else out[:, :, :r]).transpose(1, 2)


def tiled_scores(
    q: torch.Tensor, keys: torch.Tensor, seen: np.ndarray | None = None, gather: bool = False
) -> torch.Tensor:
    """q [B, R, D] . keys [B, S, D] -> FP64 [B, R, S] (S a multiple of `KEY_TILE`), every dot product in a
    fixed-shape [TILE_ROWS, D] x [D, KEY_TILE] GEMM with fixed operand layouts (contiguous row tile,
    contiguous transposed key tile): a (row, key) score depends on nothing else. `seen` (see
    `_tile_products`): only the tiles where it holds are computed, the others are 0 (to be masked)."""
    bsz, r, d = q.shape
    s = keys.shape[1]
    if s % KEY_TILE:
        raise ValueError(f"keys.shape[1] = {s} must be a multiple of KEY_TILE = {KEY_TILE}")
    n_tiles = s // KEY_TILE
    qt = _row_tiles(q.double()).contiguous()[:, :, None]  # [B, Rt, 1, 8, D]
    kt = keys.double().view(bsz, n_tiles, KEY_TILE, d).transpose(-1, -2).contiguous()  # [B, St, D, KT]
    if seen is not None or not gather:  # (`gather=False`: the per-tile loop, a reference for tests)
        out = _tile_products(qt, kt, seen)  # [B, Rt, St, 8, KT]
    else:  # every tile: one gathered product list (one bmm call on the CPU instead of one per tile)
        rt = qt.shape[1]
        bi, ri, ti = (x.reshape(-1) for x in np.indices((bsz, rt, n_tiles)))
        ia = torch.from_numpy(bi * rt + ri).to(q.device)
        ib = torch.from_numpy(bi * n_tiles + ti).to(q.device)
        prods = _products(qt.reshape(bsz * rt, TILE_ROWS, d), kt.reshape(bsz * n_tiles, d, KEY_TILE), ia, ib)
        out = prods.view(bsz, rt, n_tiles, TILE_ROWS, KEY_TILE)
    return out.permute(0, 1, 3, 2, 4).reshape(bsz, -1, s)[:, :r]


def _products(a: torch.Tensor, b: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor) -> torch.Tensor:
    """a[ia[j]] @ b[ib[j]] for every j: a [Na, m, k], b [Nb, k, n] -> [len(ia), m, n]. Each product is one
    [m, k] x [k, n] GEMM whatever else shares its call (see `bmm`): off the CPU the backend's `tile_bmm`
    with the indices (NVIDIA: one kernel, no gathered copies), on the CPU `gathered_chunked_bmm`."""
    if a.device.type != "cpu":
        return _device_ops().tile_bmm(a, b, ia, ib)
    return gathered_chunked_bmm(a, b, ia, ib)


def _seen_from_queries(q_seen: np.ndarray, heads: int, row_tiles: int) -> np.ndarray:
    """q_seen bool [B, M, T] (query m sees some column of key tile t) -> bool [B, Rt, T]: whether any row
    of score row tile r (rows m * heads + h, in tiles of `TILE_ROWS`; padding rows see nothing) does."""
    bsz, m, t = q_seen.shape
    rows = np.arange(row_tiles * TILE_ROWS) // heads
    seen = q_seen[:, np.minimum(rows, m - 1), :] & (rows < m)[None, :, None]
    return seen.reshape(bsz, row_tiles, TILE_ROWS, t).any(axis=2)


class AttentionPlan:
    """Which (row tile, key tile) pairs of a `sink_attention` call some row sees, as index tensors: a
    function of the visibility mask and the head count only, so the paged runtime builds it once per step
    and key set and every layer reuses it (`plan_attention`)."""

    def __init__(self, visible: torch.Tensor, heads: int):
        bsz, m, s = visible.shape
        if s % KEY_TILE:
            raise ValueError(f"keys.shape[1] = {s} must be a multiple of KEY_TILE = {KEY_TILE}")
        n_tiles = s // KEY_TILE
        dev = visible.device
        rt = -(-(m * heads) // TILE_ROWS)
        vis_t = visible.view(bsz, m, n_tiles, KEY_TILE)
        # which tiles each query sees: one small [B, M, T] read to the host (no sync cost on the CPU)
        seen = _seen_from_queries(vis_t.any(dim=-1).cpu().numpy(), heads, rt)  # [B, Rt, T]
        bi, ri, ti = np.nonzero(seen)  # seen tiles in (sequence, row tile, key tile) order
        n_sel = len(bi)
        self.shape = (bsz, m, heads, n_tiles, rt)
        self.seen = seen
        # most tiles seen (short contexts, compressed entries every query sees): the dense layout with
        # only the products skipped costs less than gathering the seen tiles (measured on the tiny model)
        self.dense = n_sel > DENSE_FRACTION * seen.size
        self.visible = visible
        if self.dense:
            return
        br = bi * rt + ri  # flat row tile of each seen tile
        # order [B*Rt, K]: slot k of a row tile holds the index of its k-th seen tile (key tile order),
        # or N where it has fewer (the pad entry appended to each per-tile result)
        first = np.searchsorted(br, np.arange(bsz * rt))
        count = np.bincount(br, minlength=bsz * rt)
        k_max = max(int(count.max()) if n_sel else 0, 1)
        slot = np.arange(k_max)[None, :]
        order = np.where(slot < count[:, None], first[:, None] + slot, n_sel)
        # each seen tile's mask: tile row j of row tile r is query (r * 8 + j) // heads (padding rows
        # see nothing)
        rows = np.arange(rt * TILE_ROWS) // heads
        qrow = np.minimum(rows, m - 1).reshape(rt, TILE_ROWS)
        real = (rows < m).reshape(rt, TILE_ROWS)
        idx = [torch.from_numpy(x).to(dev) for x in (bi[:, None], qrow[ri], ti[:, None])]
        self._tile_index = (*idx, torch.from_numpy(real[ri]).to(dev)[:, :, None])
        self.hidden = self._hidden(vis_t)
        self.n_sel, self.k_max = n_sel, k_max
        self.row_tile = torch.from_numpy(br).to(dev)
        self.key_tile = torch.from_numpy(bi * n_tiles + ti).to(dev)
        self.order = torch.from_numpy(order).to(dev)
        self.heads = torch.from_numpy(np.arange(rt * TILE_ROWS) % heads).to(dev)
        self.real = torch.from_numpy(real.reshape(-1)).to(dev)
        # on the CPU with many row tiles per key tile (prefill): one call per key tile, the key tile
        # broadcast (a gathered copy per row tile would cost more than the products); few (decode), and
        # off the CPU (`tile_bmm` gathers in one call): one gathered call
        kflat = bi * n_tiles + ti
        self.by_key: list[tuple[int, torch.Tensor]] | None = None
        if dev.type == "cpu" and n_sel >= 4 * len(np.unique(kflat)):
            srt = np.argsort(kflat, kind="stable")
            cuts = np.flatnonzero(np.diff(kflat[srt])) + 1
            self.by_key = [(int(kflat[g[0]]), torch.from_numpy(g).to(dev)) for g in np.split(srt, cuts)]

    def _hidden(self, vis_t: torch.Tensor) -> torch.Tensor:
        b, q, t, real = self._tile_index
        return ~(vis_t[b, q, t] & real)

    def for_visible(self, visible: torch.Tensor) -> AttentionPlan:
        """This plan (built for a superset of `visible`, e.g. every entry a query may select) for the exact
        mask `visible` [B, M, S]: the same tiles are computed, the ones no row of the exact mask sees give
        exact +0 partials (see `sink_attention`), so the bits are those of a plan of `visible` itself.
        Device ops only: `visible` (a top-k selection, on the GPU) is never read to the host."""
        if visible.shape != self.visible.shape:
            raise ValueError(
                f"for_visible: mask {tuple(visible.shape)} for a plan of {tuple(self.visible.shape)}"
            )
        plan = copy.copy(self)
        plan.visible = visible
        if not self.dense:
            plan.hidden = self._hidden(visible.view(*visible.shape[:2], -1, KEY_TILE))
        return plan


def _plan_products(plan: AttentionPlan, a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a[ia[j]] @ b[plan.key_tile[j]] for every seen tile j (see `_products`; on the CPU with many row
    tiles per key tile one call per key tile, the key tile broadcast)."""
    if plan.by_key is None:
        return _products(a, b, ia, plan.key_tile)
    out = a.new_empty(plan.n_sel, a.shape[1], b.shape[2])
    for kt, idx in plan.by_key:
        out[idx] = bmm(a[ia[idx]], b[kt].expand(len(idx), -1, -1))
    return out


def plan_attention(visible: torch.Tensor, heads: int) -> AttentionPlan:
    """The `AttentionPlan` of visible [B, M, S] for `heads` query heads."""
    return AttentionPlan(visible, heads)


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    all_tiles: bool = False,
    plan: AttentionPlan | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sink attention (K = V) with a batch-independent reduction order; FP64 [B, M, nh, D].

    q [B, M, nh, D] (M queries sharing key set b), keys [B, S, D] with S a multiple of `KEY_TILE` laid
    out in aligned tiles (`aligned_span`, `key_tiles`), visible [B, M, S] bool (or its `plan`), sinks
    [nh]. A query's result depends only on its own q, its visible keys and their tile columns.

    Only the (row tile, key tile) pairs some row of the row tile sees are computed (`AttentionPlan`):
    their score products, mask, exp and P.V products, each on whole tiles, gathered into one list of
    tiles. The others are exactly what the full computation (`all_tiles=True`, `_sink_attention_full`,
    kept as the reference the tests compare with bit for bit) gets for them: scores masked to -inf, so
    they do not change a row's max, exp 0, and a P.V partial of +0 (an all-zero P tile: the GEMM sums
    products of +0 from a +0 accumulator; measured), which leaves the tile-order sum unchanged wherever
    it is added (x + 0 = x for every x but -0, and no partial is ever -0 for the same reason).

    `own` (optional): each query's own keys after the shared ones, (keys [B, M, Ko, D], visible bool
    [B, M, Ko]) with Ko from `own_layout` (the top-k selected compressed entries in `own_order`): scored
    per query (`_own_scores`), in the softmax with the shared keys, and their P.V partials per own tile
    added after the shared tiles' (`_own_partials`, `_with_own`). Why not the selected entries as columns
    of shared entry tiles: a decode query then scores every entry tile (nearly all are seen), 10x the
    keys the selection holds.
    """
    if all_tiles:
        return _sink_attention_full(q, keys, visible, sinks, scale, own=own)
    bsz, m, nh, d = q.shape
    if exact_scores_apply(q, keys):  # (own scores take the same products on every path)
        vis = visible if visible is not None else plan.visible
        if m == 1:  # decode: one query per key set
            return _one_query_attention(q, keys, vis, sinks, scale, own)
        seen = plan.seen if plan is not None else None
        return _exact_attention_blocks(q, keys, vis, sinks, scale, seen, own)
    if plan is None:
        plan = AttentionPlan(visible, nh)
    if plan.shape[:3] != (bsz, m, nh) or plan.shape[3] * KEY_TILE != keys.shape[1]:
        raise ValueError(
            f"attention plan for {plan.shape} does not fit q {tuple(q.shape)}, keys {tuple(keys.shape)}"
        )
    if plan.dense:
        return _sink_attention_full(q, keys, plan.visible, sinks, scale, plan.seen, own)
    n_tiles, rt = plan.shape[3:]
    dev = q.device
    # score products of the seen tiles only
    qt = _row_tiles(q.reshape(bsz, m * nh, d).double()).reshape(bsz * rt, TILE_ROWS, d)
    kd = keys.double().reshape(bsz * n_tiles, KEY_TILE, d)
    kt = kd.transpose(-1, -2).contiguous()  # [B*T, D, KT]: contiguous transposed key tiles
    scores = _plan_products(plan, qt, plan.row_tile, kt) * scale  # [N, 8, KT]
    scores = scores.masked_fill(plan.hidden, float("-inf"))
    # the sink as column 0 of one more tile per row (whole-tile exp, as for the scores); padding rows
    # get sink 0 so that their max is finite and all their exps 0
    sink_val = torch.where(plan.real, sinks.to(dev, torch.float64)[plan.heads], 0.0)
    sink = q.new_full((bsz * rt * TILE_ROWS, KEY_TILE), float("-inf"), dtype=torch.float64)
    sink[:, 0] = sink_val.repeat(bsz)
    # each row's max: over its seen tiles and the sink (max is exact: any grouping gives the same value)
    tile_mx = torch.cat((scores.amax(dim=-1), scores.new_full((1, TILE_ROWS), float("-inf"))))
    mx = torch.maximum(tile_mx[plan.order].amax(dim=1), sink[:, 0].view(bsz * rt, TILE_ROWS))
    own_sc = None
    if own is not None:  # the own keys' max per (query, head) row, in the row tile layout
        own_sc = _own_scores(q, own, scale)
        own_mx = q.new_full((bsz, rt * TILE_ROWS), float("-inf"), dtype=torch.float64)
        own_mx[:, : m * nh] = own_sc.amax(dim=-1).view(bsz, m * nh)
        mx = torch.maximum(mx, own_mx.view(bsz * rt, TILE_ROWS))
    e = torch.exp(scores - mx[plan.row_tile][:, :, None])  # [N, 8, KT]
    e_sink = torch.exp(sink - mx.view(-1, 1))[:, 0]  # [B*Rt*8]
    # unnormalised P.[K | 1] of the seen tiles: value sums and softmax denominator from one fixed GEMM
    vals = torch.cat((kd, kd.new_ones(bsz * n_tiles, KEY_TILE, 1)), dim=-1)  # [B*T, KT, D+1]
    part = _plan_products(plan, e, torch.arange(plan.n_sel, device=dev), vals)  # [N, 8, D+1]
    # partials of a row tile in key tile order (`order`), the missing slots the +0 of an unseen tile
    part = torch.cat((part, part.new_zeros(1, TILE_ROWS, d + 1)))[plan.order]
    if dev.type == "cpu":
        # the CPU cumsum is a sequential sum from +0 in index order (one pass): the same additions as
        # the loop below, in one call instead of k_max
        acc = torch.cumsum(part, dim=1)[:, -1]
    else:  # (a GPU cumsum is a parallel scan: another order)
        acc = part[:, 0]
        for k in range(1, plan.k_max):
            acc = acc + part[:, k]
    acc = acc.reshape(bsz, rt * TILE_ROWS, d + 1)[:, : m * nh].reshape(bsz, m, nh, d + 1)
    if own is not None:
        row_mx = mx.view(bsz, rt * TILE_ROWS)[:, : m * nh].reshape(bsz, m, nh)
        acc = _with_own(acc, _own_partials(own_sc, row_mx, own))
    den = acc[..., d] + e_sink.reshape(bsz, rt * TILE_ROWS)[:, : m * nh].reshape(bsz, m, nh)
    return acc[..., :d] / den[..., None]


def _masked_exp(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`exp(x)` for `x` that is -inf exactly where `visible` (a 0/1 FP64 tensor, broadcast against `x`) is 0,
    bit for bit `torch.exp(x)` for finite visible entries: the -inf entries take exp(0) and are multiplied by
    0, the visible ones by 1 (exact; NaN stays NaN). Why not `torch.exp(x)`: on the AVX-512 host the exp of
    an argument out of its range (-inf included) ran several times slower than of one in range (measured:
    [8, 128, 256] FP64 with 88% of it -inf, 1.8 vs 0.2 ms), and most of a prefill chunk's scores are masked.
    (Only a visible -inf, from an infinite key, would differ: exp(0) = 1 instead of 0.)"""
    return torch.exp(x.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0)).mul_(visible)


def _one_query_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`sink_attention` bit for bit for one query per key set (decode), q [B, 1, nh, D] and keys [B, S, D]
    FP32-valued (`exact_scores_apply`), without the tile plan's padding, gathers and per-tile calls:

    - scores: `row_scores` (one NN bmm, keys as rows; the same bits as the tiled score products);
    - scale, mask, max, exp as in `_sink_attention_full`, on [B, S, nh] (S a multiple of `KEY_TILE`, so
      every exp runs in whole SIMD vectors, as there);
    - P.[K | 1]: the same fixed [TILE_ROWS, KEY_TILE] x [KEY_TILE, D + 1] products of contiguous tiles
      (head h is row h % TILE_ROWS of row tile h // TILE_ROWS, as `_row_tiles` lays out a query's heads;
      the other rows zero; with at most `PV_HALF_ROWS` heads, tiles of that many rows, whose rows have
      the same bits), all in one bmm, and the tile partials added in tile order from +0 (cumsum).
    Tested against `_sink_attention_full` (`test_one_query_attention_is_the_tile_computation`)."""
    bsz, _, nh, d = q.shape
    s = keys.shape[1]
    n_tiles = s // KEY_TILE
    rt = -(-nh // TILE_ROWS)
    sc = row_scores(q.reshape(bsz, nh, d), keys).transpose(1, 2) * scale  # [B, S, nh], contiguous
    vis = visible.reshape(bsz, s, 1)
    sc = sc.masked_fill_(~vis, float("-inf"))
    sink = sinks.to(q.device, torch.float64)
    own_sc = None if own is None else _own_scores(q, own, scale)  # [B, 1, nh, Ko]
    mx = _own_max(torch.maximum(sc.amax(dim=1), sink)[:, None], own_sc)[:, 0]  # [B, nh] (max: exact)
    e = _masked_exp(sc - mx[:, None, :], vis.double())  # [B, S, nh]
    # the sink's exp in a whole tile per sequence (columns past nh: exp(0), unused; not -inf, whose exp is
    # slow, see `_masked_exp`)
    width = rt * TILE_ROWS * KEY_TILE
    sk = q.new_zeros((bsz, width), dtype=torch.float64)
    sk[:, :nh] = sink - mx
    e_sink = torch.exp(sk)[:, :nh]
    # P tiles [B, T, Rt * rows, KT]: row h = head h, padding rows zero. With at most `PV_HALF_ROWS` heads
    # the tiles have that many rows instead of TILE_ROWS: the rows of a [4, KT] x [KT, D + 1] product
    # have the bits of the same rows of the [8, KT] tile (MKL computes a row of a full 4-row register
    # block the same way; measured, and tested: `test_half_pv_tile_rows_equal_the_full_tile`), and a
    # 4-head decode row would otherwise multiply 4 zero rows per tile
    rows = PV_HALF_ROWS if nh <= PV_HALF_ROWS else TILE_ROWS
    rt_pv = -(-nh // rows)
    ev = e.view(bsz, n_tiles, KEY_TILE, nh).transpose(2, 3)
    if rt_pv * rows == nh:
        pt = ev.contiguous()
    else:
        pt = e.new_zeros(bsz, n_tiles, rt_pv * rows, KEY_TILE)
        pt[:, :, :nh] = ev
    vals = torch.cat((keys, keys.new_ones(bsz, s, 1)), dim=-1).view(bsz, n_tiles, 1, KEY_TILE, d + 1)
    if rt_pv > 1:
        vals = vals.expand(-1, -1, rt_pv, -1, -1)
    vals = vals.reshape(-1, KEY_TILE, d + 1)
    part = bmm(pt.view(-1, rows, KEY_TILE), vals).view(bsz, n_tiles, rt_pv * rows, d + 1)
    if q.device.type == "cpu":  # a sequential sum from +0 in tile order (see `sink_attention`)
        acc = torch.cumsum(part, dim=1)[:, -1, :nh]
    else:
        acc = part[:, 0, :nh]
        for t in range(1, n_tiles):
            acc = acc + part[:, t, :nh]
    if own is not None:
        acc = _with_own(acc[:, None], _own_partials(own_sc, mx[:, None], own))[:, 0]
    den = acc[..., d] + e_sink
    return (acc[..., :d] / den[..., None]).view(bsz, 1, nh, d)


def _exact_attention_blocks(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    seen: np.ndarray | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`sink_attention` bit for bit for M queries per key set (prefill chunks, verification blocks) with
    FP32-valued q and keys (`exact_scores_apply`): `_exact_attention` on blocks of queries, each against
    the whole key tiles some row of the block sees (the sliding-window band: a block of b queries scores
    about b + window keys, not the whole chunk). Tiles a block does not see contribute exactly what they
    contribute in the full computation: -inf scores (no effect on the max), exp 0, and a P.V partial of
    +0 that the tile-order sum adds as x + 0 = x; so starting the sum at the block's first seen tile
    changes no bit (see `sink_attention`). Blocks start at query boundaries that are also row-tile
    boundaries (m0 * nh a multiple of `TILE_ROWS`), so every P tile holds the same rows as in the full
    layout. `seen` (bool [B, Rt, T], optional): which (row tile, key tile) pairs some row sees."""
    bsz, m, nh, _ = q.shape
    n_tiles = keys.shape[1] // KEY_TILE
    rt = -(-(m * nh) // TILE_ROWS)
    if seen is None:
        seen = _seen_from_queries(visible.view(bsz, m, n_tiles, KEY_TILE).any(dim=-1).cpu().numpy(), nh, rt)
    align = TILE_ROWS // np.gcd(nh, TILE_ROWS)  # queries per block: a multiple of this
    block = max(align, (EXACT_BLOCK_QUERIES // align) * align)
    if block >= m:
        return _exact_attention(q, keys, visible, sinks, scale, seen, own)
    out = []
    for m0 in range(0, m, block):
        m1 = min(m, m0 + block)
        r0, r1 = m0 * nh // TILE_ROWS, -(-(m1 * nh) // TILE_ROWS)
        cols = np.flatnonzero(seen[:, r0:r1].any(axis=(0, 1)))
        if not len(cols):  # no row of the block sees a key: the sink alone (one tile of hidden keys)
            cols = np.zeros(1, dtype=np.int64)
        k0, k1 = int(cols[0]), int(cols[-1]) + 1
        c0, c1 = k0 * KEY_TILE, k1 * KEY_TILE
        out.append(
            _exact_attention(
                q[:, m0:m1],
                mark_fp32_valued(keys[:, c0:c1]),
                visible[:, m0:m1, c0:c1],
                sinks,
                scale,
                seen[:, r0:r1, k0:k1],
                None if own is None else (own[0][:, m0:m1], own[1][:, m0:m1]),
            )
        )
    return torch.cat(out, dim=1)


def _exact_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    seen: np.ndarray | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`_sink_attention_full` bit for bit for FP32-valued q [B, M, nh, D] and keys [B, S, D]
    (`exact_scores_apply`), with the scores from `row_scores` (one NN bmm, keys as rows; the same bits as
    the tiled score products) instead of the per-tile score GEMMs:

    - scale, mask, max and exp element by element on [B, S, M * nh] (contiguous, S a multiple of
      `KEY_TILE`: every exp runs in whole SIMD vectors, as there); the sink's exp in whole tiles too;
    - P.[K | 1]: the same fixed [TILE_ROWS, KEY_TILE] x [KEY_TILE, D + 1] products of contiguous P tiles
      (row j of row tile r = row r * 8 + j of the M * nh (query, head) rows, as `_row_tiles` lays them
      out), one bmm per (sequence, key tile) over the row tiles that see it (`seen`: the hull of them;
      the rest stay the +0 the full computation gets), and the tile partials added in tile order.
    Tested against `_sink_attention_full` (`test_exact_attention_is_the_tile_computation`)."""
    bsz, m, nh, d = q.shape
    s = keys.shape[1]
    n_tiles = s // KEY_TILE
    r = m * nh
    rt = -(-r // TILE_ROWS)
    sc = row_scores(q.reshape(bsz, r, d), keys).transpose(1, 2) * scale  # [B, S, R], contiguous
    vis = visible.transpose(1, 2).contiguous()[..., None]  # [B, S, M, 1]
    sc = sc.view(bsz, s, m, nh).masked_fill_(~vis, float("-inf")).view(bsz, s, r)
    sink = sinks.to(q.device, torch.float64)
    own_sc = None if own is None else _own_scores(q, own, scale)
    row_mx = _own_max(torch.maximum(sc.amax(dim=1).view(bsz, m, nh), sink), own_sc)  # (max: exact)
    mx = row_mx.view(bsz, 1, r)
    e = _masked_exp((sc - mx).view(bsz, s, m, nh), vis.double()).view(bsz, s, r)  # [B, S, R]
    # the sinks' exps in whole tiles (numel a multiple of KEY_TILE)
    n_sk = bsz * r
    sk = q.new_zeros(n_sk + (-n_sk) % KEY_TILE, dtype=torch.float64)
    sk[:n_sk] = (sink - mx.view(bsz, m, nh)).reshape(-1)
    e_sink = torch.exp(sk)[:n_sk].view(bsz, m, nh)
    # P tiles [B, T, Rt, 8, KT] (contiguous), zero rows past R
    ep = e if rt * TILE_ROWS == r else torch.cat((e, e.new_zeros(bsz, s, rt * TILE_ROWS - r)), dim=2)
    pt = ep.view(bsz, n_tiles, KEY_TILE, rt, TILE_ROWS).permute(0, 1, 3, 4, 2).contiguous()
    vals = torch.cat((keys, keys.new_ones(bsz, s, 1)), dim=-1).view(bsz, n_tiles, KEY_TILE, d + 1)
    if rt == 1:  # one row tile per key tile: every product in one call, partials added in tile order
        part = bmm(pt.view(-1, TILE_ROWS, KEY_TILE), vals.view(-1, KEY_TILE, d + 1))
        part = part.view(bsz, n_tiles, TILE_ROWS, d + 1)
        acc = part[:, 0]
        for t in range(1, n_tiles):
            acc = acc + part[:, t]
    else:
        # each (sequence, key tile): the hull [lo, hi) of the row tiles that see it, from the host mask
        if seen is None:
            lo, hi = np.zeros((bsz, n_tiles), dtype=np.int64), np.full((bsz, n_tiles), rt)
        else:
            any_row = seen.any(axis=1)  # [B, T]
            lo = np.where(any_row, seen.argmax(axis=1), 0)
            hi = np.where(any_row, rt - seen[:, ::-1].argmax(axis=1), 0)
        # the partials of a row tile added in key tile order; a row tile outside a key tile's hull gets
        # the +0 the full computation adds there (x + 0 = x), so it is skipped
        acc = pt.new_zeros(bsz, rt, TILE_ROWS, d + 1)
        for t in range(n_tiles):
            for b in range(bsz):
                r0, r1 = int(lo[b, t]), int(hi[b, t])
                if r1 > r0:
                    acc[b, r0:r1] += torch.bmm(pt[b, t, r0:r1], vals[b, t].expand(r1 - r0, -1, -1))
    acc = acc.reshape(bsz, rt * TILE_ROWS, d + 1)[:, :r].view(bsz, m, nh, d + 1)
    if own is not None:
        acc = _with_own(acc, _own_partials(own_sc, row_mx, own))
    den = acc[..., d] + e_sink
    return acc[..., :d] / den[..., None]


def _sink_attention_full(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    seen: np.ndarray | None = None,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`sink_attention` with the mask / exp / max over every key column and every (row tile, key tile)
    product, or (`seen`, bool [B, Rt, T]) only the products of seen pairs (the others stay the +0 they
    would be). With `seen` None: the reference the tile skipping must match bit for bit (tests)."""
    bsz, m, nh, d = q.shape
    s = keys.shape[1]
    if s % KEY_TILE:
        raise ValueError(f"keys.shape[1] = {s} must be a multiple of KEY_TILE = {KEY_TILE}")
    scores = tiled_scores(q.reshape(bsz, m * nh, d), keys, seen).view(bsz, m, nh, s) * scale
    n_tiles = s // KEY_TILE
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    # the sink as column 0 of one more tile: every exp below runs on whole tiles (no scalar tail)
    sink = scores.new_full((bsz, m, nh, KEY_TILE), float("-inf"))
    sink[..., 0] = sinks.to(sink.device, torch.float64)[None, None, :]
    logits = torch.cat((scores, sink), dim=-1)
    own_sc = None if own is None else _own_scores(q, own, scale)
    mx = _own_max(logits.amax(dim=-1), own_sc)  # [B, M, nh]
    e = torch.exp(logits - mx[..., None])
    # unnormalised P·[K | 1]: the value sums and the softmax denominator from the same fixed GEMM
    kd = keys.double().view(bsz, n_tiles, KEY_TILE, d)
    vals = torch.cat((kd, kd.new_ones(bsz, n_tiles, KEY_TILE, 1)), dim=-1)  # [B, St, KT, D+1]
    pt = _row_tiles(e[..., :s].reshape(bsz, m * nh, s))  # [B, Rt, 8, S]
    rt = pt.shape[1]
    pt = (
        pt.view(bsz, rt, TILE_ROWS, n_tiles, KEY_TILE).permute(0, 1, 3, 2, 4).contiguous()
    )  # [B, Rt, St, 8, KT]
    part = _tile_products(pt, vals, seen)  # [B, Rt, St, 8, D+1]
    acc = part[:, :, 0]
    for t in range(1, n_tiles):  # tile order, one tile at a time: padding tiles add exact zeros
        acc = acc + part[:, :, t]
    acc = acc.reshape(bsz, -1, d + 1)[:, : m * nh].view(bsz, m, nh, d + 1)
    if own is not None:
        acc = _with_own(acc, _own_partials(own_sc, mx, own))
    den = acc[..., d] + e[..., s]
    return acc[..., :d] / den[..., None]
