"""Routed experts and the shared expert: clamped SwiGLU MLPs, and the MoE combine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import batch_invariant
from ..numerics import KERNEL_ROUNDINGS, carrier, linear, narrow_act, native, round_to, weight_as
from ..ops.model_calls import ops_for
from ..ops.registry import get_ops


@dataclass
class MLPWeights:
    """One SwiGLU MLP: `w1` (gate) and `w3` (up) [I, H], `w2` (down) [H, I]; dequantised."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor


@dataclass
class ExpertWeights:
    """All routed experts stacked: `w1`, `w3` [E, I, H], `w2` [E, H, I]."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`silu(min(gate, L)) * clamp(up, -L, L)` in `dtype` (None: the carrier, `numerics.carrier()`), unrounded."""
    dtype = dtype or carrier()
    g = gate.to(dtype).clamp(max=limit)
    return g * torch.sigmoid(g) * up.to(dtype).clamp(-limit, limit)


def mlp(x: torch.Tensor, w: MLPWeights, limit: float, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unweighted clamped SwiGLU MLP (the shared expert) -> [T, H] rounded to act_dtype (an act-dtype tensor
    where `numerics.narrow_act`, else the carrier)."""
    if batch_invariant.enabled() and x.device.type == "cpu":
        bi = _bi_grouped((w.w1, w.w3), (w.w2,))
        if bi is not None:  # (the 2-D x of every caller; one group)
            flat = x.reshape(-1, x.shape[-1])
            fp32 = batch_invariant.marked_fp32_valued(x)  # (rounded input: no test of every value)
            out = _bi_swiglu(flat, [flat.shape[0]], None, *bi, limit, act_dtype, False, fp32)
            return out.reshape(*x.shape[:-1], out.shape[-1])
    if narrow_act(act_dtype):
        # native 16-bit: the projections stay in the act dtype and the registry's `swiglu` rounds h once
        # (the same values as widening both to FP32 and rounding h in the down projection, without the
        # three [T, I] FP32 tensors and their elementwise passes: ~4 ms of a 16k-token medium prefill)
        gate, up = linear(x, w.w1, act_dtype, narrow=True), linear(x, w.w3, act_dtype, narrow=True)
        # (the output too stays BF16: every caller adds it to an FP32 sum, which widens it exactly)
        return linear(ops_for(gate).swiglu(gate, up, limit, act_dtype), w.w2, act_dtype, narrow=True)
    h = clamped_swiglu(linear(x, w.w1, act_dtype), linear(x, w.w3, act_dtype), limit)
    return linear(h, w.w2, act_dtype)


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: ExpertWeights,  # or quant_sm90.Fp8Experts
    shared: MLPWeights | None,
    limit: float,
    act_dtype: torch.dtype = torch.float32,
    weight_before_down: bool = False,
) -> torch.Tensor:
    """Sum over the k routed slots (in slot order) plus the shared expert, in the carrier dtype, one rounding -> [T, H].

    `x` [T, H] in the carrier, or held in the act dtype (native mode's narrow sub-layer input): every GEMM
    takes act-dtype operands either way (`numerics.linear`), so the values are the same.

    `weight_before_down` scales the SwiGLU output by the routing weight before `w2` (V4.1); the public V4
    scales the expert output after `w2`. Equal in exact arithmetic.

    `experts` may also be `quant_sm90.Fp8Experts` (loaded with `DEEPINFER_FP8_EXPERTS=1`): the routed
    sum then comes from the `grouped_expert_mlp` op (FP8 1x128 activation casts, BF16 GEMM outputs, an
    FP32 sum over slots), the shared expert is added and the result rounded once, as here.
    """
    if not isinstance(experts, ExpertWeights):
        from ..quant_sm90 import Fp8Experts

        if isinstance(experts, Fp8Experts):
            # ops -> backends -> layers: imported at call time
            from ..ops.model_calls import grouped_expert_mlp

            # (x widened to the carrier where it is held in BF16, `ShiftedHC`: the op's NVIDIA activation
            # cast takes another kernel for a BF16 input, not checked bit for bit against this one)
            out = grouped_expert_mlp(x.to(carrier()), weights, ids, experts, limit, weight_before_down)
            if shared is not None:
                out += mlp(x, shared, limit, act_dtype)
            return round_to(out, act_dtype)
    t, k = ids.shape
    if native() and x.is_cuda and not batch_invariant.enabled():
        # native mode on a GPU: three grouped GEMMs over all experts and no host sync, instead of three
        # GEMMs per expert plus the FP32 conversions around each (the loop was ~70 of a 16k-token medium
        # prefill step's 370 ms on the H200, 19 of them GEMMs)
        return experts_forward_static(
            x, weights, ids, experts, shared, limit, act_dtype, weight_before_down, "grouped"
        )
    n_experts = experts.w1.shape[0]
    # One host sync per call: the (token, slot) pairs are sorted by expert id (stable, so each expert's
    # rows keep token-major order) and only the per-expert counts are read back; every gather below is
    # an integer index, never a boolean mask (each `nonzero` / `unique` is a device->host sync).
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()  # the only host sync
    if len(counts) > n_experts:
        raise ValueError(f"expert ids must lie in [0, {n_experts}), got an id {len(counts) - 1}")
    xs = x[torch.div(order, k, rounding_mode="floor")]  # [T*k, H] rows grouped by expert
    ws = weights.reshape(-1)[order].to(carrier()).unsqueeze(-1)
    # y of pair p = t*k + slot lands in row p of `ys`, i.e. ys.view(T, k, H)[t, slot]
    ys = torch.empty(t * k, x.shape[1], dtype=carrier(), device=x.device)
    bi = None
    if batch_invariant.enabled() and x.device.type == "cpu":
        bi = _bi_grouped((experts.w1, experts.w3), (experts.w2,))
    if bi is not None:  # batch-invariant mode: every expert in one GEMM call per projection
        fp32 = batch_invariant.marked_fp32_valued(x)  # (xs holds rows of x)
        ys.index_copy_(0, order, _bi_swiglu(xs, counts, ws, *bi, limit, act_dtype, weight_before_down, fp32))
    lo = 0
    for e, count in enumerate(counts if bi is None else []):  # (nothing left to do after the grouped path)
        if not count:
            continue
        hi = lo + count
        xr, wr = xs[lo:hi], ws[lo:hi]
        h = clamped_swiglu(linear(xr, experts.w1[e], act_dtype), linear(xr, experts.w3[e], act_dtype), limit)
        if weight_before_down:
            y = linear(h * wr, experts.w2[e], act_dtype)
        else:
            y = linear(h, experts.w2[e], act_dtype) * wr
        ys.index_copy_(0, order[lo:hi], y)  # indices are distinct: deterministic
        lo = hi
    return _slot_sum(ys.view(t, k, x.shape[1]), x, shared, limit, act_dtype)


def _bi_grouped(up: tuple, down: tuple) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """Batch-invariant mode on the CPU: the cached grouped operands of `batch_invariant.grouped_gemm`
    (gate | up side by side, down) with the intermediate and hidden sizes, or None where it does not
    apply (weights not FP32-valued or too large to hold in FP64): the callers then take `linear`
    (`row_gemm`) per expert."""
    p13 = batch_invariant.stacked_parts(*up)
    p2 = batch_invariant.stacked_parts(*down) if p13 is not None else None
    return None if p2 is None else (p13, p2, up[0].shape[-2], down[0].shape[-2])


def _bi_swiglu(
    xs: torch.Tensor,
    counts: list[int],
    ws: torch.Tensor | None,
    p13: torch.Tensor,
    p2: torch.Tensor,
    inter: int,
    hidden: int,
    limit: float,
    act_dtype: torch.dtype,
    weight_before_down: bool,
    fp32_valued: bool = False,
) -> torch.Tensor:
    """Clamped SwiGLU MLPs of rows `xs` grouped by expert (`counts`), each row weighted by `ws` (None: 1),
    with the roundings of the `linear` calls of the loop (gate, up and down each rounded to act_dtype),
    in two `grouped_gemm` calls (gate and up of every expert in one, the down projections in the
    other) instead of three calls per expert. A row's result depends on that row only. `fp32_valued`:
    the rows of `xs` are known to be FP32-valued (`grouped_gemm` skips testing them)."""
    gu = batch_invariant.grouped_gemm(xs.double(), counts, p13, fp32_valued=fp32_valued)
    h = clamped_swiglu(
        round_to(gu[:, :inter], act_dtype), round_to(gu[:, inter : 2 * inter], act_dtype), limit
    )
    if ws is not None and weight_before_down:
        h = h * ws
    y = round_to(batch_invariant.grouped_gemm(h, counts, p2)[:, :hidden], act_dtype)
    return y * ws if ws is not None and not weight_before_down else y


# Pairs whose gathered expert weights `experts_forward_static` may hold at once on the per-pair path
# (elements of w1 + w3 + w2 per pair times pairs); above it, native mode takes the grouped GEMM.
GATHER_ELEMENTS = 1 << 26
# Pairs per bmm call of the exact per-pair path (`_gathered_bmm`): bounds its FP64 weight copies.
PAIR_CHUNK = 64


def experts_forward_static(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: ExpertWeights,
    shared: MLPWeights | None,
    limit: float,
    act_dtype: torch.dtype = torch.float32,
    weight_before_down: bool = False,
    method: str = "auto",
) -> torch.Tensor:
    """`experts_forward` without a host sync and with shapes fixed by [T, k] (graph-safe decode).

    Each (token, slot) pair p = t*k + slot is computed on its own row, so no per-expert row count is
    read back:

    * `gather` (exact mode, or few pairs): the pair's expert weights are gathered ([T*k, I, H]) and the
      three projections are batched products of one row each. Exact mode: every output element is the
      same FP64 dot product as `linear`'s and is rounded at the same points, so results equal
      `experts_forward`'s (bitwise unless an FP64 sum, accumulated in another order, straddles an
      act-dtype rounding boundary).
    * `grouped` (native mode only): pairs sorted by expert (stable), `torch._grouped_mm` over the
      stacked weights with device-side group offsets; act-dtype operands, the GEMM rounds its output to
      act_dtype as `linear` does (equal to the loop within FP32 accumulation order).

    `auto`: `grouped` in native mode when the gathered weights would exceed `GATHER_ELEMENTS`, else
    `gather`. The slot sum, shared expert and final rounding are `experts_forward`'s.
    """
    if method not in ("auto", "gather", "grouped"):
        raise ValueError(f"method must be 'auto', 'gather' or 'grouped', got {method!r}")
    if not isinstance(experts, ExpertWeights):
        raise ValueError(f"the graph-safe expert path takes ExpertWeights, got {type(experts).__name__}")
    t, k = ids.shape
    pairs = ids.reshape(-1).long()
    inter, hidden = experts.w1.shape[1], experts.w1.shape[2]
    if method == "auto":
        big = t * k * 3 * inter * hidden > GATHER_ELEMENTS
        method = "grouped" if native() and big else "gather"
    if method == "grouped" and not native():
        raise ValueError("method='grouped' needs DEEPINFER_NUMERICS=native (no FP64 grouped GEMM)")
    project = _pair_linear
    bi = batch_invariant.enabled()
    if bi and x.device.type == "cpu":
        bi_parts = _bi_grouped((experts.w1, experts.w3), (experts.w2,))
        if bi_parts is None:
            raise ValueError(
                "batch-invariant mode on the CPU: the graph-safe expert path needs FP32-valued expert "
                "weights within batch_invariant.PART_CACHE_BYTES (batch_invariant.stacked_parts)"
            )
    elif bi:
        project = _pair_tiled
    if method == "grouped":
        return _grouped_swiglu_sum(x, weights, pairs, experts, shared, limit, act_dtype, weight_before_down)
    xs = x.repeat_interleave(k, dim=0)  # row p = token p // k
    ws = weights.reshape(-1).to(carrier()).unsqueeze(-1)
    if bi and x.device.type == "cpu":
        fp32 = batch_invariant.marked_fp32_valued(x)
        y = _bi_pair_swiglu(xs, pairs, ws, *bi_parts, limit, act_dtype, weight_before_down, fp32)
    else:
        h = clamped_swiglu(
            project(xs, experts.w1, pairs, act_dtype), project(xs, experts.w3, pairs, act_dtype), limit
        )
        if weight_before_down:
            y = project(h * ws, experts.w2, pairs, act_dtype)
        else:
            y = project(h, experts.w2, pairs, act_dtype) * ws
    return _slot_sum(y.view(t, k, -1), x, shared, limit, act_dtype)


def _slot_sum(
    ys: torch.Tensor, x: torch.Tensor, shared: MLPWeights | None, limit: float, act_dtype: torch.dtype
) -> torch.Tensor:
    """The routed outputs [T, k, H] summed in slot order plus the shared expert (`_slot_total`), rounded once."""
    addend = mlp(x, shared, limit, act_dtype) if shared is not None else None
    return round_to(_slot_total(ys, addend, carrier()), act_dtype)


def _slot_total(ys: torch.Tensor, addend: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The routed outputs [T, k, H] summed in slot order from zeros (0 + y is y except for -0.0, exactly as
    a per-slot accumulation), then `addend` [T, H] (None: nothing), in `dtype`, unrounded."""
    out = torch.zeros(ys.shape[0], ys.shape[2], dtype=dtype, device=ys.device)
    for slot in range(ys.shape[1]):
        out += ys[:, slot]
    if addend is not None:
        out += addend
    return out


def _grouped_swiglu_sum(
    x: torch.Tensor,
    weights: torch.Tensor,
    pairs: torch.Tensor,
    experts: ExpertWeights,
    shared: MLPWeights | None,
    limit: float,
    act_dtype: torch.dtype,
    weight_before_down: bool,
) -> torch.Tensor:
    """Native mode: the routed MLP of every (token, slot) pair summed per token with the shared expert and
    rounded once (`_slot_sum`'s order and rounding) by the `expert_swiglu_sum` op, with act-dtype operands
    (the stacked weights converted once, cached) -> [T, H] in the carrier dtype, or as an act-dtype tensor
    where `numerics.narrow_act` (the same values; its consumer, the mHC write, takes either)."""
    addend = mlp(x, shared, limit, act_dtype) if shared is not None else None
    return get_ops().expert_swiglu_sum(
        x.to(act_dtype),
        pairs,
        weights,
        weight_as(experts.w1, act_dtype),
        weight_as(experts.w3, act_dtype),
        weight_as(experts.w2, act_dtype),
        limit,
        weight_before_down,
        addend,
        act_dtype,
        act_dtype if narrow_act(act_dtype) else carrier(),
    )


def grouped_swiglu(
    x: torch.Tensor,
    pairs: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weight_before_down: bool,
) -> torch.Tensor:
    """The `expert_swiglu` reference: three `torch._grouped_mm` calls over all experts. The pairs are
    sorted by expert once (stable) and stay in that order through gate, up, SwiGLU and down; only the
    act-dtype token rows are gathered (not FP32 copies per projection) and the result is put back in
    pair order once. The GEMMs round their outputs to x.dtype as `linear` does; the elementwise math is
    `experts_forward`'s, in FP32. No host sync (graph-safe)."""
    t = x.shape[0]
    k = pairs.numel() // max(t, 1)
    pairs = pairs.reshape(-1).long()
    order = torch.argsort(pairs, stable=True)
    # group ends: how many pairs have an expert id <= e (no bincount: CUDA's reads back its max)
    ends = torch.searchsorted(pairs[order], torch.arange(w1.shape[0], device=x.device), right=True)
    ends = ends.to(torch.int32)
    xs = x[torch.div(order, k, rounding_mode="floor")]  # row i: token of pair order[i]

    def project(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends).to(torch.float32)

    ws = weights.reshape(-1)[order].to(torch.float32).unsqueeze(-1)
    h = clamped_swiglu(project(xs, w1), project(xs, w3), limit).float()
    if weight_before_down:
        y = project((h * ws).to(x.dtype), w2)
    else:
        y = project(h.to(x.dtype), w2) * ws
    back = torch.empty_like(y)
    back[order] = y
    return back


def grouped_swiglu_sum(
    x: torch.Tensor,
    pairs: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weight_before_down: bool,
    addend: torch.Tensor | None,
    act_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The `expert_swiglu_sum` reference: `grouped_swiglu`'s pair rows summed per token in slot order in FP32
    from zeros, plus `addend` [T, H] (the shared expert) (`_slot_total`), rounded once to act_dtype ->
    [T, H] out_dtype."""
    t, hidden = x.shape[0], w2.shape[1]
    k = pairs.numel() // max(t, 1)
    ys = grouped_swiglu(x, pairs, weights, w1, w3, w2, limit, weight_before_down).view(t, k, hidden)
    return _slot_total(ys, addend, torch.float32).to(act_dtype).to(out_dtype)


def _pair_exact(x: torch.Tensor, w: torch.Tensor, fp32_valued: bool) -> torch.Tensor:
    """Row p of FP64 `x` [P, K] times `w[p]` ([P, K, N], FP64 parts of at most 24 significant bits) with
    every product exact, as `batch_invariant.grouped_gemm` computes the row (hi = the row rounded to FP32,
    plus the lo rest's product where the row has one), one matrix per row: an exact-product row has the
    same bits for every M (see `batch_invariant.exact_gemm`)."""
    hi = x if fp32_valued else x.float().double()
    out = torch.bmm(hi.unsqueeze(1), w).squeeze(1)
    if fp32_valued:
        return out
    lo = x - hi
    has_lo = lo.ne(0).any(dim=1, keepdim=True)
    return torch.where(has_lo, out + torch.bmm(lo.unsqueeze(1), w).squeeze(1), out)


def _bi_pair_swiglu(
    xs: torch.Tensor,
    pairs: torch.Tensor,
    ws: torch.Tensor,
    p13: torch.Tensor,
    p2: torch.Tensor,
    inter: int,
    hidden: int,
    limit: float,
    act_dtype: torch.dtype,
    weight_before_down: bool,
    fp32_valued: bool,
) -> torch.Tensor:
    """`_bi_swiglu` (batch-invariant mode on the CPU) graph-safe: each (token, slot) pair on its own row
    against its expert's gathered grouped operands, the same roundings; bitwise `_bi_swiglu`'s row."""
    gu = _pair_exact(xs.double(), p13[pairs], fp32_valued)
    h = clamped_swiglu(
        round_to(gu[:, :inter], act_dtype), round_to(gu[:, inter : 2 * inter], act_dtype), limit
    )
    if weight_before_down:
        h = h * ws
    y = round_to(_pair_exact(h, p2[pairs], False)[:, :hidden], act_dtype)
    return y if weight_before_down else y * ws


def _gathered_bmm(a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, chunk: int) -> torch.Tensor:
    """`a[p] @ w[pairs[p]].T` in FP64 for `a` [P, R, K] (P a multiple of `chunk`), `chunk` pairs per bmm
    call, each call gathering (and widening) only its own experts' matrices: one FP64 copy per pair of
    the whole step would take batch x top-k x N x K x 8 bytes (16 GB per projection at 512 pairs of a
    4096 x 1024 expert). The [K, N] operands are views with `weight.t()`'s layout, as `linear` uses."""
    out = [
        torch.bmm(a[i : i + chunk], w[pairs[i : i + chunk]].to(torch.float64).transpose(1, 2))
        for i in range(0, a.shape[0], chunk)
    ]
    return out[0] if len(out) == 1 else torch.cat(out)


def pair_tiled_products(x: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The reference `pair_rows_matmul` op (batch-invariant mode off the CPU): FP64 row p of `x` times
    expert `pairs[p]`'s matrix of `w` [E, N, K] as `batch_invariant.tiled_matmul` computes a row of
    `linear` there: the row in a fixed [TILE_ROWS, K] tile (the other rows zero), against the FP64 weight
    in its transposed layout, `DEVICE_BATCH` matrices per bmm call."""
    rows, k = x.shape
    chunk, tile = batch_invariant.DEVICE_BATCH, batch_invariant.TILE_ROWS
    pad = (-rows) % chunk
    if pad:  # padding pairs use expert 0 against zero rows
        pairs = torch.cat((pairs, pairs.new_zeros(pad)))
    a = x.new_zeros(rows + pad, tile, k, dtype=torch.float64)
    a[:rows, 0] = x.double()
    return _gathered_bmm(a, w, pairs, chunk)[:rows, 0]


def _pair_tiled(
    x: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, act_dtype: torch.dtype
) -> torch.Tensor:
    """Batch-invariant mode off the CPU: row p of `x` times expert `pairs[p]`'s matrix of `w`, with the
    bits `linear` gives that row there (the backend's `pair_rows_matmul`), rounded to act_dtype."""
    if act_dtype in KERNEL_ROUNDINGS:  # rounded by the kernel (as `numerics.linear` has it rounded)
        out = get_ops().pair_rows_matmul(x.double().contiguous(), w, pairs, act_dtype)
        return batch_invariant.mark_fp32_valued(out)
    return round_to(get_ops().pair_rows_matmul(x.double().contiguous(), w, pairs), act_dtype)


def _pair_linear(
    x: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, act_dtype: torch.dtype
) -> torch.Tensor:
    """Row p of `x` [P, K] times expert `pairs[p]`'s matrix of `w` [E, N, K] (transposed), as `linear`:
    exact: FP64 products rounded once to act_dtype; native: act-dtype operands, FP32 out."""
    if native():
        wp = weight_as(w, act_dtype)[pairs]  # the stack converted once (cached), then gathered
        return torch.bmm(x.to(act_dtype).unsqueeze(1), wp.transpose(1, 2)).squeeze(1).to(torch.float32)
    out = _gathered_bmm(x.double().unsqueeze(1), w, pairs, PAIR_CHUNK)
    return round_to(out.squeeze(1), act_dtype)
