"""`grouped_expert_mlp` on the GPU (DeepGEMM M-grouped FP8, and the dequantised BF16 fallback) against
the CPU reference: fresh random MXFP4 experts converted to the SM90 FP8 layout, random routing, several
shapes, the caching allocator poisoned with NaN bytes before every GPU call."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from deepinfer_model.backends.nvidia import moe  # noqa: E402
from deepinfer_model.ops import get_ops  # noqa: E402
from deepinfer_model.quant import quant_mxfp4  # noqa: E402
from deepinfer_model.quant_sm90 import fp8_experts_from_mxfp4  # noqa: E402

DEV = torch.device("cuda")
HAS_DEEP_GEMM = importlib.util.find_spec("deep_gemm") is not None


def poison() -> None:
    """Fill the allocator's free blocks with 0xFF bytes (NaN in every float dtype), then release them."""
    big = [torch.full((256 << 20,), 0xFF, dtype=torch.uint8, device=DEV) for _ in range(2)]
    small = [torch.full((1 << 20,), 0xFF, dtype=torch.uint8, device=DEV) for _ in range(32)]
    del big, small


def make_case(t: int, e: int, k: int, h: int, i: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def stack(n, kk):
        parts = [quant_mxfp4(torch.randn(n, kk, generator=gen) * kk**-0.5) for _ in range(e)]
        return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])

    ex = fp8_experts_from_mxfp4(stack(i, h), stack(i, h), stack(h, i))
    x = (torch.randn(t, h, generator=gen) * 3).to(torch.bfloat16)
    w, ids = torch.rand(t, e, generator=gen).topk(k, dim=1)
    return ex, x, (w / w.sum(1, keepdim=True) * 1.5).float(), ids


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double().cpu()
    assert bool(torch.isfinite(out).all()), "NaN/Inf in output (unwritten rows or overflow)"
    return float((out - ref.double()).norm() / ref.double().norm().clamp(min=1e-300))


SHAPES = [(1, 8, 2), (7, 8, 6), (300, 32, 6), (300, 8, 4)]  # tokens, experts, top-k


@pytest.mark.parametrize("t,e,k", SHAPES)
@pytest.mark.parametrize("h,i", [(512, 256), (1024, 384)])
@pytest.mark.parametrize("impl", ["registry", "dequant"])
def test_grouped_expert_mlp_vs_cpu(t, e, k, h, i, impl):
    wbd = (t + e) % 2 == 0  # both weight placements across the shapes
    ex, x, w, ids = make_case(t, e, k, h, i, seed=t * 7 + e + h)
    limit = 4.0  # x * 3 makes some gate/up values exceed it: the clamp is exercised
    ref = get_ops("cpu").grouped_expert_mlp(x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2, limit, wbd)
    fn = get_ops("nvidia").grouped_expert_mlp if impl == "registry" else moe.grouped_expert_mlp_dequant
    args = [a.to(DEV) for a in (x, w, ids, ex.w13, ex.s13, ex.w2, ex.s2)]
    poison()
    out = fn(*args, limit, wbd)
    torch.cuda.synchronize()
    assert out.shape == (t, h) and out.dtype == torch.float32 and out.device.type == "cuda"
    assert rel_err(out, ref) <= 1e-2


def test_registry_picks_deep_gemm_when_it_imports():
    name = get_ops("nvidia").grouped_expert_mlp.__name__
    expected = "grouped_expert_mlp_deep_gemm" if HAS_DEEP_GEMM else "grouped_expert_mlp_dequant"
    import os

    if os.environ.get("DEEPINFER_DEEP_GEMM", "1") == "0":
        expected = "grouped_expert_mlp_dequant"
    assert name == expected


@pytest.mark.skipif(not HAS_DEEP_GEMM, reason="deep_gemm not installed")
def test_deep_gemm_alignment_is_what_the_plan_uses():
    import deep_gemm

    align = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    assert align == moe._alignment()
    plan = moe.plan_grouped_rows(torch.randint(0, 8, (33, 4), device=DEV), 8, align)
    assert plan.num_rows % align == 0 and plan.m_indices.device.type == "cuda"
