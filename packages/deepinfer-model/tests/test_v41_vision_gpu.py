"""The vision tower on CUDA: BF16 math and fused attention by default, against the CPU's FP64 path, and the
memory of one V4.1-Flash encoder block at 1,024 merged cells (9,216 patches): the fused attention must not
hold the [heads, N, N] scores."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from deepinfer_model.models.deepseek_v41 import (  # noqa: E402
    DeepseekV41Config,
    random_v41_tensors,
    tiny_v41_config_dict,
)
from deepinfer_model.models.deepseek_v41.vision import (  # noqa: E402
    VisionBlockWeights,
    VisionConfig,
    VisionTower,
    VisionWeights,
)

DEV = torch.device("cuda")
# The V4.1-Flash encoder (issue 49), with one block: the memory of one block is the question here.
FLASH_ONE_BLOCK = VisionConfig(
    hidden_size=1024, downsample_ratio=3, num_hidden_layers=1, num_attention_heads=16, intermediate_size=2816
)


def _tiny_tower(device) -> VisionTower:
    cfg = DeepseekV41Config.from_dict(tiny_v41_config_dict(vision_tower=True))
    values = {k: v.to(torch.bfloat16).float().to(device) for k, v in random_v41_tensors(cfg, seed=5).items()}
    return VisionTower(cfg.vision, VisionWeights.from_tensors(cfg.vision, values.__getitem__))


@pytest.mark.parametrize("rows,cols", [(2, 2), (6, 4), (8, 8)])
def test_cuda_default_is_bf16_fused_and_matches_the_cpu_fp64(rows, cols):
    """BF16 tolerance as in the CPU BF16 test (test_v41_vision_encoder.py): below 8 u = 3.1e-2 relative."""
    cpu, gpu = _tiny_tower("cpu"), _tiny_tower(DEV)
    assert gpu.default_dtype == torch.bfloat16
    g = torch.Generator().manual_seed(rows * 100 + cols)
    patches = torch.rand(rows * cols, cpu.config.patch_dim, generator=g) * 2 - 1
    want = cpu.embed_image(patches, rows, cols, dtype=torch.float64)
    got = gpu.embed_image(patches.to(DEV), rows, cols)
    assert got.dtype == torch.bfloat16 and got.device.type == "cuda"
    assert float((got.double().cpu() - want).norm() / want.norm()) < 8 * 2**-8
    fp32 = gpu.embed_image(patches.to(DEV), rows, cols, dtype=torch.float32, attention="fused")
    # FP32 on CUDA: cuBLAS and the memory-efficient SDPA kernel sum in other orders than the CPU (2e-4 there)
    torch.testing.assert_close(fp32.double().cpu(), want, rtol=1e-3, atol=1e-3)


def test_fused_attention_holds_no_n_by_n_scores_at_1024_cells():
    vcfg = FLASH_ONE_BLOCK
    side = 32 * vcfg.downsample_ratio  # 32 x 32 merged cells = 96 x 96 patches
    n = side * side
    g = torch.Generator(DEV).manual_seed(0)
    W, inter, d = vcfg.hidden_size, vcfg.intermediate_size, 1024

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=DEV) * shape[-1] ** -0.5

    block = VisionBlockWeights(
        norm1=torch.ones(W, device=DEV),
        qkv=rnd(3 * W, W),
        qkv_bias=torch.zeros(3 * W, device=DEV),
        proj=rnd(W, W),
        norm2=torch.ones(W, device=DEV),
        w13=rnd(2 * inter, W),
        w2=rnd(W, inter),
    )
    weights = VisionWeights(
        patch_embed=rnd(W, vcfg.patch_dim),
        patch_bias=torch.zeros(W, device=DEV),
        blocks=[block],
        norm=torch.ones(W, device=DEV),
        fc1=rnd(d, 9 * W),
        fc1_bias=torch.zeros(d, device=DEV),
        fc2=rnd(d, d),
        fc2_bias=torch.zeros(d, device=DEV),
    )
    tower = VisionTower(vcfg, weights)
    tower.weights_for(torch.bfloat16)
    patches = torch.rand(n, vcfg.patch_dim, generator=g, device=DEV) * 2 - 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = tower.embed_image(patches, side, side)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # 2.7 GB: what an N x N path would hold at least; the fused block needs a few hundred MB
    scores_bf16 = vcfg.num_attention_heads * n * n * 2
    assert out.shape == (32 * 32, d) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert peak < scores_bf16 / 2, (
        f"peak {peak / 2**30:.2f} GiB vs N x N scores {scores_bf16 / 2**30:.2f} GiB"
    )
