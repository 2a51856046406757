"""The grouped-expert layout helpers of backends/nvidia/moe.py and the `grouped_expert_mlp` op, on the CPU.

The helpers are pure torch; here they run on CPU tensors against naive per-pair loops in float64. The
DeepGEMM path itself is covered by test_grouped_moe_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_model.backends.nvidia import moe
from deepinfer_model.layers.experts import clamped_swiglu
from deepinfer_model.ops import get_ops
from deepinfer_model.ops.model_calls import grouped_expert_mlp as model_grouped_expert_mlp
from deepinfer_model.quant import fake_quant_fp8, quant_mxfp4
from deepinfer_model.quant_sm90 import dequant_fp8_block_pow2, fp8_experts_from_mxfp4


def random_routing(t: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(t, e, generator=gen)
    w, ids = scores.topk(k, dim=1)
    return w / w.sum(1, keepdim=True) * 1.5, ids


@pytest.mark.parametrize("t,e,k,align", [(1, 8, 2, 128), (7, 8, 6, 128), (300, 32, 6, 128), (50, 4, 3, 16)])
def test_plan_matches_a_naive_per_expert_layout(t, e, k, align):
    gen = torch.Generator().manual_seed(t * 100 + e)
    _, ids = random_routing(t, e, k, gen)
    plan = moe.plan_grouped_rows(ids, e, align)
    # naive: for each expert in order, its (token, slot) pairs in row-major order, then padding to `align`
    rows, row_of = [], {}
    for ex in range(e):
        pairs = [(tt, s) for tt in range(t) for s in range(k) if int(ids[tt, s]) == ex]
        for p in pairs:
            row_of[p] = len(rows)
            rows.append((ex, p[0]))
        rows += [(-1, 0)] * (-len(pairs) % align)
    assert plan.num_rows == len(rows) and plan.num_rows % align == 0
    assert plan.m_indices.dtype == torch.int32
    assert plan.m_indices.tolist() == [r[0] for r in rows]
    assert plan.src_token.tolist() == [r[1] for r in rows]
    assert plan.row_of.tolist() == [[row_of[(tt, s)] for s in range(k)] for tt in range(t)]
    assert plan.counts.tolist() == [int((ids == ex).sum()) for ex in range(e)]
    # DeepGEMM reads each aligned block's expert from its first row: no block mixes experts
    blocks = plan.m_indices.view(-1, align)
    assert bool(((blocks == blocks[:, :1]) | (blocks == -1)).all()) and bool((blocks[:, 0] >= 0).all())


def test_plan_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"lie in \[0, 4\)"):
        moe.plan_grouped_rows(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        moe.plan_grouped_rows(torch.tensor([0, 1]), 4)
    with pytest.raises(ValueError, match="integer"):
        moe.plan_grouped_rows(torch.zeros(2, 2), 4)


def test_combine_sums_slots_in_order_and_shows_unwritten_rows():
    y = torch.randn(10, 4, dtype=torch.bfloat16)
    row_of = torch.tensor([[3, 0], [5, 9]])
    sc = torch.tensor([[0.5, 2.0], [1.0, -1.0]])
    out = moe.combine_rows(y, row_of, sc)
    ref = torch.stack([y[3].float() * 0.5 + y[0].float() * 2.0, y[5].float() - y[9].float()])
    assert torch.equal(out, ref)
    y[9] = float("nan")  # a row no GEMM wrote: the combine must not hide it behind a zero fill
    assert bool(torch.isnan(moe.combine_rows(y, row_of)[1]).all())


def make_experts(e: int, i: int, h: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def stack(n, k):
        parts = [quant_mxfp4(torch.randn(n, k, generator=gen) * k**-0.5) for _ in range(e)]
        return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])

    return fp8_experts_from_mxfp4(stack(i, h), stack(i, h), stack(h, i))


def naive_pairs(x, w, ids, ex, limit, weight_before_down):
    """Every (token, slot) pair on its own, FP64, spec 6.2 rounding points."""
    i = ex.intermediate
    w13 = dequant_fp8_block_pow2(ex.w13, ex.s13)
    w2 = dequant_fp8_block_pow2(ex.w2, ex.s2)
    xq = fake_quant_fp8(x.float(), 128).double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e, wt = int(ids[t, s]), float(w[t, s])
            gu = (w13[e] @ xq[t]).to(torch.bfloat16).double()
            h = clamped_swiglu(gu[:i], gu[i:], limit)
            if weight_before_down:
                h = h * wt
            y = (w2[e] @ fake_quant_fp8(h.float().unsqueeze(0), 128).double()[0]).to(torch.bfloat16).double()
            out[t] += y if weight_before_down else (y * wt).float().double()
    return out


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("t,e,k,wbd", [(1, 8, 2, True), (7, 8, 6, False), (40, 32, 4, True)])
def test_cpu_op_and_layout_pipeline_vs_naive_pairs(t, e, k, wbd):
    gen = torch.Generator().manual_seed(7 + t)
    h, i, limit = 256, 128, 4.0
    ex = make_experts(e, i, h, seed=t)
    x = (torch.randn(t, h, generator=gen) * 3).to(torch.bfloat16)
    w, ids = random_routing(t, e, k, gen)
    ref = naive_pairs(x, w, ids, ex, limit, wbd)
    cpu = get_ops("cpu").grouped_expert_mlp(x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2, limit, wbd)
    assert cpu.dtype == torch.float32 and cpu.shape == (t, h)
    assert rel(cpu, ref) < 1e-6
    # the NVIDIA fallback's sorted/padded layout and combine, run on CPU tensors (BF16 GEMMs)
    lay = moe.grouped_expert_mlp_dequant(x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2, limit, wbd)
    assert lay.dtype == torch.float32 and bool(torch.isfinite(lay).all())
    assert rel(lay, ref) < 1e-3  # measured 5e-8; wrong slots or weight placement give > 3e-2
    # the model's call site (ops.model_calls) on CPU tensors uses the cpu reference
    assert torch.equal(model_grouped_expert_mlp(x.double(), w, ids, ex, limit, wbd), cpu.double())


def test_op_bad_shapes():
    ex = make_experts(2, 128, 256, seed=0)
    x, w, ids = torch.randn(3, 256), torch.rand(3, 2), torch.randint(0, 2, (3, 2))
    f = moe.grouped_expert_mlp_dequant
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, 128\]"):
        f(x[:, :128], w, ids, ex.w13, ex.s13, ex.w2, ex.s2, 1.0)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        f(x, w[:, :1], ids, ex.w13, ex.s13, ex.w2, ex.s2, 1.0)
    with pytest.raises(ValueError, match="s2 must be"):
        f(x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2[:, :1], 1.0)
    with pytest.raises(ValueError, match="multiples of 128"):
        f(x[:, :64], w, ids, ex.w13[:, :, :64], ex.s13[:, :, :1], ex.w2[:, :64], ex.s2[:, :1], 1.0)
    assert f(x[:0], w[:0], ids[:0], ex.w13, ex.s13, ex.w2, ex.s2, 1.0).shape == (0, 256)


def test_intermediate_not_a_multiple_of_128_is_zero_padded():
    """I = 64 (the tiny config): padded to 128 at conversion; the op equals a naive loop on the unpadded
    weights whose Q8 of h uses the one 64-wide group (zeros do not change a group's amax)."""
    from deepinfer_model.quant import dequant_mxfp4

    gen = torch.Generator().manual_seed(11)
    e, i, h, t, k, limit = 4, 64, 128, 9, 2, 4.0
    mx = [
        [quant_mxfp4(torch.randn(n, kk, generator=gen) * kk**-0.5) for _ in range(e)]
        for n, kk in ((i, h), (i, h), (h, i))
    ]
    stacked = [(torch.stack([p for p, _ in m]), torch.stack([s for _, s in m])) for m in mx]
    ex = fp8_experts_from_mxfp4(*stacked)
    assert ex.w13.shape == (e, 256, h) and ex.w2.shape == (e, h, 128) and ex.stats.inexact_blocks == 0
    w1, w3, w2 = ([dequant_mxfp4(p, s).double() for p, s in m] for m in mx)
    x = (torch.randn(t, h, generator=gen) * 3).to(torch.bfloat16)
    w, ids = random_routing(t, e, k, gen)
    ref = torch.zeros(t, h, dtype=torch.float64)
    xq = fake_quant_fp8(x.float(), 128).double()
    for tt in range(t):
        for s in range(k):
            j = int(ids[tt, s])
            g = (w1[j] @ xq[tt]).to(torch.bfloat16).double()
            u = (w3[j] @ xq[tt]).to(torch.bfloat16).double()
            hh = clamped_swiglu(g, u, limit) * float(w[tt, s])
            ref[tt] += (
                (w2[j] @ fake_quant_fp8(hh.float().unsqueeze(0), 64).double()[0]).to(torch.bfloat16).double()
            )
    out = get_ops("cpu").grouped_expert_mlp(x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2, limit, True)
    assert rel(out, ref) < 1e-6
    lay = moe.grouped_expert_mlp_dequant(x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2, limit, True)
    assert rel(lay, ref) < 1e-3
