"""Routed experts on SM90: DeepGEMM's M-grouped contiguous FP8 GEMMs, or a dequantised BF16 fallback.

One call computes, for every (token, slot) pair, the clamped-SwiGLU expert MLP of spec v41-model 6.2:
    [g | u] = W13_e . Q8(x)          (bf16 out)
    h       = silu(min(g, L)) * clamp(u, -L, L) [* w]     (FP32)
    o       = W2_e . Q8(h)            (bf16 out) [* w]
and sums the k slots of each token in slot order in FP32. Q8 is the per-token 1x128 power-of-two FP8
quantisation of `gemm.quant_act_fp8` (DeepGEMM's SM90 activation granularity).

Layout (`plan_grouped_rows`): the T*k pairs are sorted by expert (stable, so rows of one expert keep
token order) and each expert's rows start at a multiple of DeepGEMM's M alignment (128 on SM90:
`deep_gemm.get_mk_alignment_for_contiguous_layout()`); `m_indices` holds the expert of every row and -1
on padding rows. DeepGEMM reads the group of each 128-row block from its first row and skips blocks
(per 64-row warpgroup) whose first row is -1, so padding rows are either computed with their block's
expert (never read back) or left unwritten (never read back).

The padded row count depends on the routing, so the plan syncs with the host once per call (eager
mode; decode under CUDA graphs would need the fixed upper bound T*k + E*(align-1)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gemm

DEFAULT_ALIGNMENT = 128  # DeepGEMM's legacy/SM90 M alignment for the contiguous layout


@dataclass
class GroupedRows:
    """Where each (token, slot) pair lives in the expert-sorted, alignment-padded row layout."""

    m_indices: torch.Tensor  # [M] int32: expert of each row, -1 on padding rows
    src_token: torch.Tensor  # [M] int64: token whose activation fills each row (0 on padding rows)
    row_of: torch.Tensor  # [T, k] int64: the row of pair (t, slot)
    counts: torch.Tensor  # [E] int64: pairs per expert
    padded_counts: torch.Tensor  # [E] int64: rows per expert (counts rounded up to the alignment)

    @property
    def num_rows(self) -> int:
        return self.m_indices.shape[0]


def plan_grouped_rows(
    topk_ids: torch.Tensor, num_experts: int, alignment: int = DEFAULT_ALIGNMENT
) -> GroupedRows:
    """Sort the pairs of `topk_ids` [T, k] by expert into DeepGEMM's M-grouped contiguous layout.

    Pure torch on topk_ids' device; one host sync (the total padded row count).
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if alignment <= 0:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    t, k = topk_ids.shape
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and bool(((flat < 0) | (flat >= num_experts)).any()):
        raise ValueError(
            f"topk_ids must lie in [0, {num_experts}), got min {int(flat.min())} max {int(flat.max())}"
        )
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(padded, 0) - padded  # first row of each expert
    order = torch.sort(flat, stable=True).indices  # pair indices grouped by expert, token order within
    sorted_e = flat[order]
    first_in_sorted = torch.cumsum(counts, 0) - counts  # position of each expert's first pair in `order`
    rank = torch.arange(flat.numel(), device=dev) - first_in_sorted[sorted_e]
    rows_sorted = starts[sorted_e] + rank
    row_of = torch.empty_like(flat)
    row_of[order] = rows_sorted
    m = int(padded.sum())  # host sync: the buffer sizes depend on the routing
    m_indices = torch.full((m,), -1, dtype=torch.int32, device=dev)
    m_indices[rows_sorted] = sorted_e.to(torch.int32)
    src_token = torch.zeros(m, dtype=torch.long, device=dev)
    src_token[rows_sorted] = order // k if k else order
    return GroupedRows(m_indices, src_token, row_of.view(t, k), counts, padded)


def combine_rows(y: torch.Tensor, row_of: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum over slots (in slot order) of y[row_of[t, slot]] (* scale[t, slot]), FP32 [T, H].

    A gather per slot, no atomics: the sum order is fixed, and an unwritten row shows up (no zero init).
    """
    t, k = row_of.shape
    if k == 0:
        return torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    out = None
    for slot in range(k):
        part = y[row_of[:, slot]].float()
        if scale is not None:
            part = part * scale[:, slot : slot + 1].float()
        out = part if out is None else out + part
    return out


def swiglu_rows(gu: torch.Tensor, limit: float, row_weight: torch.Tensor | None) -> torch.Tensor:
    """Clamped SwiGLU of the gate/up GEMM output [M, 2I] (bf16) in FP32, times the row's routing weight."""
    i = gu.shape[1] // 2
    g = gu[:, :i].float().clamp(max=limit)
    h = g * torch.sigmoid(g) * gu[:, i:].float().clamp(-limit, limit)
    if row_weight is not None:
        h = h * row_weight.unsqueeze(-1)
    return h


def _check(x, topk_weights, topk_ids, w13, s13, w2, s2) -> None:
    if x.dim() != 2:
        raise ValueError(f"grouped_expert_mlp: x must be [T, H], got {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"grouped_expert_mlp: topk_ids and topk_weights must both be [T={t}, k], got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(
            f"grouped_expert_mlp: w13 [E, 2I, H] and w2 [E, H, I] expected, got {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    e, i2, h_ = w13.shape
    if h_ != h or i2 % 2 or tuple(w2.shape[1:]) != (h, i2 // 2):
        raise ValueError(
            f"grouped_expert_mlp: with x [T, {h}], w13 must be [E, 2I, {h}] and w2 [E, {h}, I]; got "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    if h % gemm.BLOCK or (i2 // 2) % gemm.BLOCK:
        raise ValueError(
            f"grouped_expert_mlp: H={h} and I={i2 // 2} must be multiples of {gemm.BLOCK} (FP8 1x128 activation groups)"
        )
    for name, s, w in (("s13", s13, w13), ("s2", s2, w2)):
        want = (e, -(-w.shape[1] // gemm.BLOCK), -(-w.shape[2] // gemm.BLOCK))
        if tuple(s.shape) != want:
            raise ValueError(f"grouped_expert_mlp: {name} must be {list(want)}, got {list(s.shape)}")


def _alignment() -> int:
    try:
        import deep_gemm

        return int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    except (ImportError, AttributeError):
        return DEFAULT_ALIGNMENT


def _grouped_mlp(x, topk_weights, topk_ids, w13, s13, w2, s2, limit, weight_before_down, gemm_fn, alignment):
    _check(x, topk_weights, topk_ids, w13, s13, w2, s2)
    t, h = x.shape
    if t == 0 or topk_ids.shape[1] == 0:
        return torch.zeros(t, h, dtype=torch.float32, device=x.device)
    plan = plan_grouped_rows(topk_ids, w13.shape[0], alignment)
    # Q8 per token (T rows, not T*k), from x's own values: an FP32 (or FP64-carried) activation is not
    # rounded to bf16 first, so the op matches the reference in the model's FP32 mode too
    if x.dtype == torch.bfloat16:
        xq, xs = gemm.ACT_QUANT(x.contiguous())
    else:
        xq, xs = gemm.quant_act_fp8(x.float())
    aq, a_s = xq[plan.src_token], xs[plan.src_token].contiguous()
    gu = gemm_fn(aq, a_s, w13, s13, plan)
    row_w = torch.zeros(plan.num_rows, dtype=torch.float32, device=x.device)
    row_w[plan.row_of.reshape(-1)] = topk_weights.reshape(-1).float()
    hid = swiglu_rows(gu, limit, row_w if weight_before_down else None)
    hq, hs = gemm.quant_act_fp8(hid)  # Q8 of the FP32 h itself (ACT_QUANT's TileLang cast takes bf16)
    y = gemm_fn(hq, hs, w2, s2, plan)
    return combine_rows(y, plan.row_of, None if weight_before_down else topk_weights)


def _deep_gemm_grouped(aq, a_s, w, s, plan: GroupedRows) -> torch.Tensor:
    import deep_gemm

    d = torch.empty(plan.num_rows, w.shape[1], dtype=torch.bfloat16, device=aq.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((aq, a_s), (w, s.float()), d, plan.m_indices)
    return d


def _dequant_grouped(aq, a_s, w, s, plan: GroupedRows) -> torch.Tensor:
    """Per active expert: exact BF16 dequantisation of both operands, one BF16 GEMM (FP32 accumulation)."""
    m, k = aq.shape
    a = (aq.float().view(m, k // gemm.BLOCK, gemm.BLOCK) * a_s.unsqueeze(-1)).view(m, k).to(torch.bfloat16)
    d = torch.zeros(m, w.shape[1], dtype=torch.bfloat16, device=aq.device)
    starts = (torch.cumsum(plan.padded_counts, 0) - plan.padded_counts).tolist()
    for e, (start, n) in enumerate(zip(starts, plan.counts.tolist(), strict=True)):
        if n == 0:
            continue
        sc = s[e].float().repeat_interleave(gemm.BLOCK, 0).repeat_interleave(gemm.BLOCK, 1)
        we = (w[e].float() * sc[: w.shape[1], : w.shape[2]]).to(torch.bfloat16)
        d[start : start + n] = a[start : start + n] @ we.t()
    return d


def grouped_expert_mlp_deep_gemm(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    weight_before_down: bool = True,
) -> torch.Tensor:
    """The registry op on SM90: DeepGEMM's M-grouped contiguous FP8 GEMMs."""
    args = (x, topk_weights, topk_ids, w13, s13, w2, s2, limit, weight_before_down)
    return _grouped_mlp(*args, _deep_gemm_grouped, _alignment())


def grouped_expert_mlp_dequant(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    weight_before_down: bool = True,
) -> torch.Tensor:
    """Fallback without DeepGEMM: the same layout and function, BF16 GEMMs per active expert (2x the
    weight bytes of FP8, one host sync for the expert loop)."""
    args = (x, topk_weights, topk_ids, w13, s13, w2, s2, limit, weight_before_down)
    return _grouped_mlp(*args, _dequant_grouped, DEFAULT_ALIGNMENT)
