"""NVIDIA ops against the CPU reference: fresh random inputs of several shapes, poisoned outputs.

Every check: relative error ||gpu - ref|| / ||ref|| (FP64) under the op's tolerance, no NaN/Inf
(the caching allocator is filled with 0xFF - NaN in every float dtype - before each GPU call, so an
unwritten output element shows up as NaN).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from deepinfer_model.ops import get_ops, store_fp8_tokens  # noqa: E402
from deepinfer_model.quant import quant_fp8_block  # noqa: E402

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def gpu():
    return get_ops("nvidia")


@pytest.fixture(scope="module")
def cpu():
    return get_ops("cpu")


def poison() -> None:
    """Fill the allocator's free blocks (large and small pools) with 0xFF bytes, then release them."""
    big = [torch.full((256 << 20,), 0xFF, dtype=torch.uint8, device=DEV) for _ in range(4)]
    small = [torch.full((1 << 20,), 0xFF, dtype=torch.uint8, device=DEV) for _ in range(32)]
    del big, small


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().double().cpu()
    assert bool(torch.isfinite(out).all()), "NaN/Inf in output (unwritten elements or overflow)"
    ref = ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-300))


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 8e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 512), (7, 1536), (257, 4096), (64, 7168), (3, 5, 512)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(gpu, cpu, dtype, shape, weighted):
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(shape[-1]) if weighted else None
    ref = cpu.rms_norm(x, w, 1e-6)
    poison()
    out = gpu.rms_norm(x.to(DEV), None if w is None else w.to(DEV), 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,rope", [((5, 512), 64), ((33, 64, 512), 64), ((8, 16, 128), 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope(gpu, cpu, dtype, shape, rope, inverse):
    x = torch.randn(shape).to(dtype)
    ang = torch.rand(shape[0], rope // 2) * 100
    cos, sin = ang.cos(), ang.sin()
    ref = cpu.apply_rope(x, cos, sin, inverse)
    poison()
    out = gpu.apply_rope(x.to(DEV), cos.to(DEV), sin.to(DEV), inverse)
    assert rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize("t,m,h", [(1, 4, 512), (19, 4, 4096), (128, 4, 7168), (5, 2, 256)])
def test_hc_mixes_read_write(gpu, cpu, t, m, h):
    trunk = torch.randn(t, m, h).to(torch.bfloat16)
    fn = torch.randn((2 + m) * m, m * h) * (m * h) ** -0.5
    base, scale = torch.randn((2 + m) * m) * 0.1, torch.rand(3) + 0.5
    refs = cpu.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, 20)
    poison()
    outs = gpu.hc_mixes(trunk.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), 1e-6, 1e-6, 20)
    for o, r in zip(outs, refs, strict=True):
        assert o.dtype == torch.float32 and o.shape == r.shape
        assert rel_err(o, r) < 1e-5
    pre, post, comb = refs
    y = torch.randn(t, h).to(torch.bfloat16)
    ref_read = cpu.hc_read(trunk, pre)
    ref_write = cpu.hc_write(y, trunk, post, comb)
    poison()
    assert rel_err(gpu.hc_read(trunk.to(DEV), pre.to(DEV)), ref_read) < tol(torch.bfloat16)
    poison()
    got = gpu.hc_write(y.to(DEV), trunk.to(DEV), post.to(DEV), comb.to(DEV))
    assert rel_err(got, ref_write) < tol(torch.bfloat16)


@pytest.mark.parametrize("t,n,k", [(1, 512, 7168), (16, 1536, 512), (129, 4096, 1024), (512, 7168, 2048)])
def test_fp8_block_linear(gpu, cpu, t, n, k):
    x = torch.randn(t, k).to(torch.bfloat16)
    w, s = quant_fp8_block(torch.randn(n, k) * k**-0.5, (128, 128))
    s = s.float()
    ref = cpu.fp8_block_linear(x, w, s)
    poison()
    out = gpu.fp8_block_linear(x.to(DEV), w.to(DEV), s.to(DEV))
    assert out.shape == (t, n) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("b,h,topk,blocks", [(1, 64, 64, 4), (5, 128, 512, 40), (33, 64, 1024, 64)])
def test_sparse_decode_attention(gpu, cpu, b, h, topk, blocks):
    page = 64
    n = blocks * page
    cache = torch.zeros(blocks, page, 1, 528, dtype=torch.uint8)
    store_fp8_tokens(torch.randn(n, 512), cache, torch.arange(n))
    idx = torch.stack([torch.randperm(n)[:topk] for _ in range(b)]).to(torch.int32)
    idx[0, topk // 2 :] = -1  # a partly filled selection
    q = torch.randn(b, h, 512).to(torch.bfloat16)
    sinks = torch.randn(h)
    ref = cpu.sparse_decode_attention(q, cache, idx, sinks, 512**-0.5)
    poison()
    out = gpu.sparse_decode_attention(q.to(DEV), cache.to(DEV), idx.to(DEV), sinks.to(DEV), 512**-0.5)
    assert out.shape == (b, h, 512)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("t, h, topk, s_kv", [(1, 64, 128, 300), (777, 64, 640, 5000), (300, 128, 200, 2048)])
def test_sparse_prefill_attention(gpu, cpu, t, h, topk, s_kv):
    """FlashMLA's SM90 sparse prefill (top-k padded to its multiple of 128) against the gather reference:
    listed keys with repeats and -1 holes, a sink per head; one row lists nothing (output 0: sink only)."""
    if gpu.sources["sparse_prefill_attention"] != "nvidia":
        pytest.skip("flash_mla does not import here")
    assert gpu.sparse_prefill_attention.supports(h, 512) and not gpu.sparse_prefill_attention.supports(4, 512)
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, h, 512, generator=g).bfloat16()
    kv = torch.randn(s_kv, 512, generator=g).bfloat16()
    idx = torch.randint(0, s_kv, (t, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(t, topk, generator=g) < 0.3] = -1
    idx[0] = -1
    sinks = torch.randn(h, generator=g)
    ref = cpu.sparse_prefill_attention(q, kv, idx, sinks, 512**-0.5)
    assert float(ref[0].abs().max()) == 0.0
    poison()
    out = gpu.sparse_prefill_attention(q.to(DEV), kv.to(DEV), idx.to(DEV), sinks.to(DEV), 512**-0.5)
    assert out.shape == (t, h, 512) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= tol(torch.bfloat16)  # measured 2.1e-3 (BF16 output)


def _index_inputs(gs, t, h, d, n, bounds, seed):
    """BF16 q / keys, FP32 head weights and per-row entry bounds: none, a prefill chunk's causal ones (ratio
    2, the chunk starting at position n: half the entries visible to its first row) or ragged ones (below 0,
    0, inside, n, past n)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(gs, t, h, d, generator=g).bfloat16()
    keys = torch.randn(gs, n, d, generator=g).bfloat16()
    w = torch.randn(gs, t, h, generator=g)
    lim = None
    if bounds == "causal":
        lim = ((torch.arange(t) + n + 1) // 2).expand(gs, t).contiguous()
    elif bounds == "ragged":
        lim = torch.randint(-2, n + 3, (gs, t), generator=g, dtype=torch.int32)
        lim[0, 0], lim[-1, -1] = 0, n + 5
    return q, keys, w, lim


def _index_check(out, out_bf16, ref, lim, n):
    """FP32 output against the reference; BF16 output the same bits as rounding the FP32 one (the kernel's
    round-to-nearest-even store); invisible entries exactly 0."""
    assert out.dtype == torch.float32 and out_bf16.dtype == torch.bfloat16 and out.shape == out_bf16.shape
    assert rel_err(out, ref) <= 1e-4
    assert rel_err(out_bf16, ref) <= 8e-3
    assert torch.equal(out_bf16, out.bfloat16())
    if lim is not None:
        hidden = torch.arange(n) >= lim.long()[..., None]
        # (a NaN left by the poisoned allocator is nonzero too)
        assert not bool(out.cpu()[hidden].any()) and not bool(out_bf16.cpu()[hidden].any())


@pytest.mark.parametrize(
    "gs, t, h, d, n", [(1, 1, 32, 128, 5), (1, 999, 32, 128, 3000), (5, 3, 64, 128, 130), (2, 17, 4, 32, 77)]
)
@pytest.mark.parametrize("bounds", [None, "causal", "ragged"])
def test_index_scores(gpu, cpu, gs, t, h, d, n, bounds):
    """The Triton weighted-ReLU index scores against the reference (BF16 operands: exact FP32 products;
    the sums differ in order only), with and without per-row entry bounds, FP32 and BF16 outputs."""
    if gpu.sources["index_scores"] != "nvidia":
        pytest.skip("triton does not import here")
    q, keys, w, lim = _index_inputs(gs, t, h, d, n, bounds, t + n)
    ref = cpu.index_scores(q, keys, w, lim)
    dev = [x.to(DEV) for x in (q, keys, w)] + [None if lim is None else lim.to(DEV)]
    poison()
    out = gpu.index_scores(*dev)
    poison()
    out_bf16 = gpu.index_scores(*dev, torch.bfloat16)
    assert out.shape == (gs, t, n)
    _index_check(out, out_bf16, ref, lim, n)


try:
    from deepinfer_model.backends.nvidia import triton_index
except ImportError:  # no triton: the registry serves the reference
    triton_index = None


@pytest.mark.skipif(triton_index is None, reason="needs triton")
@pytest.mark.parametrize("config", sorted(triton_index.CONFIGS) if triton_index else [])
@pytest.mark.parametrize("gs, t, n", [(1, 300, 1500), (3, 1, 700)])
@pytest.mark.parametrize("bounds", [None, "causal", "ragged"])
def test_index_scores_kernel_configs(cpu, config, gs, t, n, bounds):
    """Each tile configuration of the kernel itself (the registry's wrapper would hide a failing one behind
    the reference): a prefill chunk (one program per row block, a loop over the keys) and a decode batch
    (the keys split over programs)."""
    q, keys, w, lim = _index_inputs(gs, t, 32, 128, n, bounds, n)
    ref = cpu.index_scores(q, keys, w, lim)
    dev = [x.to(DEV) for x in (q, keys, w)] + [None if lim is None else lim.to(DEV)]
    poison()
    out = triton_index.index_scores(*dev, config=config)
    poison()
    out_bf16 = triton_index.index_scores(*dev, torch.bfloat16, config=config)
    _index_check(out, out_bf16, ref, lim, n)


def test_kv_store_on_gpu_matches_cpu(gpu, cpu):
    lat = torch.randn(100, 512) * 5
    slots = torch.randperm(4 * 64)[:100]
    c_ref = torch.zeros(4, 64, 1, 528, dtype=torch.uint8)
    cpu.kv_store_fp8(lat, c_ref, slots)
    c_gpu = torch.zeros(4, 64, 1, 528, dtype=torch.uint8, device=DEV)
    gpu.kv_store_fp8(lat.to(DEV), c_gpu, slots.to(DEV))
    assert torch.equal(c_gpu.cpu(), c_ref)


# --- the TileLang kernels themselves (the registry wraps them with a torch fallback, which must not
# hide a failing kernel), in both activation dtypes and with the model's FP64 carrier + out_dtype ---

try:
    from deepinfer_model.backends.nvidia import tilelang_mhc, tilelang_norm, tilelang_rope
except ImportError:  # TileLang not installed: the registry serves these ops from torch_cuda.py
    tilelang_mhc = tilelang_norm = tilelang_rope = None
from deepinfer_model.backends.nvidia import TILELANG_FALLBACKS  # noqa: E402

needs_tilelang = pytest.mark.skipif(tilelang_rope is None, reason="needs tilelang")


@needs_tilelang
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape,rope",
    [((5, 512), 64), ((33, 64, 512), 64), ((8, 16, 128), 64), ((3, 4, 128), 128), ((1, 2, 64), 32)],
)
@pytest.mark.parametrize("inverse", [False, True])
def test_tilelang_rope_kernel(cpu, dtype, shape, rope, inverse):
    x = torch.randn(shape).to(dtype)
    ang = torch.rand(shape[0], rope // 2) * 100
    cos, sin = ang.cos(), ang.sin()
    ref = cpu.apply_rope(x, cos, sin, inverse)
    poison()
    out = tilelang_rope.apply_rope(x.to(DEV), cos.to(DEV), sin.to(DEV), inverse)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < tol(dtype)
    poison()  # the reference model's FP64 carrier, rounded to out_dtype
    out64 = tilelang_rope.apply_rope(x.double().to(DEV), cos.to(DEV), sin.to(DEV), inverse, out_dtype=dtype)
    assert out64.dtype == dtype and rel_err(out64, ref) < tol(dtype)


_IN_PLACE_ROPE = [  # V4.1 query / output rows, an index query, a latent, all channels, rows over several CTAs
    ((33, 64, 512), 64),
    ((8, 64, 128), 64),
    ((5, 512), 64),
    ((3, 4, 128), 128),
    ((1, 2, 64), 32),
    ((1000, 3, 96), 48),
]


@needs_tilelang
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,rope", _IN_PLACE_ROPE)
@pytest.mark.parametrize("inverse", [False, True])
def test_tilelang_rope_in_place_kernel(cpu, dtype, shape, rope, inverse):
    """`apply_rope_`'s kernel: the CPU reference's values within tolerance, bit for bit the out-of-place
    kernel's (the same rotation, nvcc contracts it the same way), the leading channels' bits untouched."""
    x = (torch.randn(shape) * 3).to(dtype)
    ang = torch.rand(shape[0], rope // 2) * 100
    cos, sin = ang.cos(), ang.sin()
    ref = cpu.apply_rope(x, cos, sin, inverse)
    xd, cd, sd = x.to(DEV), cos.to(DEV), sin.to(DEV)
    poison()
    want = tilelang_rope.apply_rope(xd, cd, sd, inverse)
    poison()
    assert tilelang_rope.apply_rope_(xd, cd, sd, inverse) is None
    assert rel_err(xd, ref) < tol(dtype)
    assert torch.equal(xd, want)
    lead = shape[-1] - rope
    assert torch.equal(xd[..., :lead].cpu(), x[..., :lead])
    with pytest.raises(ValueError, match="apply_rope_: x must be contiguous"):
        tilelang_rope.apply_rope_(xd.transpose(0, -1), cd, sd, inverse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,rope", _IN_PLACE_ROPE[:3])
def test_registered_in_place_rope_is_the_out_of_place_op(gpu, dtype, shape, rope):
    """The table's `apply_rope_` where the backend serves it (the model uses it only then): bitwise the table's
    `apply_rope`, whatever serves that (kernel, or torch after a kernel failure)."""
    if gpu.sources.get("apply_rope_") != "nvidia":
        pytest.skip("apply_rope_ is not registered (DEEPINFER_TILELANG=all enables the unchecked kernel)")
    x = (torch.randn(shape) * 3).to(dtype).to(DEV)
    ang = (torch.rand(shape[0], rope // 2) * 100).to(DEV)
    want = gpu.apply_rope(x, ang.cos(), ang.sin(), True)
    gpu.apply_rope_(x, ang.cos(), ang.sin(), True)
    assert torch.equal(x, want)


@needs_tilelang
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,m,h", [(1, 4, 128), (19, 4, 4096), (128, 4, 7168), (5, 2, 256), (3, 4, 96)])
def test_tilelang_mhc_kernels(cpu, dtype, t, m, h):
    trunk = (torch.randn(t, m, h) * 2).to(dtype)
    fn = torch.randn((2 + m) * m, m * h) * (m * h) ** -0.5
    base, scale = torch.randn((2 + m) * m) * 0.1, torch.rand(3) + 0.5
    refs = cpu.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, 20)
    poison()
    outs = tilelang_mhc.hc_mixes(trunk.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), 1e-6, 1e-6, 20)
    for o, r in zip(outs, refs, strict=True):
        assert o.dtype == torch.float32 and o.shape == r.shape
        assert rel_err(o, r) < 1e-5
    pre, post, comb = refs
    y = torch.randn(t, h).to(dtype)
    ref_read, ref_write = cpu.hc_read(trunk, pre), cpu.hc_write(y, trunk, post, comb)
    poison()
    got = tilelang_mhc.hc_read(trunk.to(DEV), pre.to(DEV))
    assert got.dtype == dtype and rel_err(got, ref_read) < tol(dtype)
    poison()
    got = tilelang_mhc.hc_write(y.to(DEV), trunk.to(DEV), post.to(DEV), comb.to(DEV))
    assert got.dtype == dtype and rel_err(got, ref_write) < tol(dtype)
    poison()
    got = tilelang_mhc.hc_write(
        y.double().to(DEV), trunk.double().to(DEV), post.to(DEV), comb.to(DEV), out_dtype=dtype
    )
    assert got.dtype == dtype and rel_err(got, ref_write) < tol(dtype)


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@needs_triton
@pytest.mark.parametrize("t,m,h", [(1, 4, 128), (19, 4, 4096), (1000, 4, 4096), (5, 2, 256), (3, 3, 96)])
@pytest.mark.parametrize("iters", [1, 20])
def test_triton_mhc_mixes_kernel(cpu, t, m, h, iters):
    from deepinfer_model.backends.nvidia import triton_mhc

    trunk = (torch.randn(t, m, h) * 2).to(torch.bfloat16)
    fn = torch.randn((2 + m) * m, m * h) * (m * h) ** -0.5
    base, scale = torch.randn((2 + m) * m) * 0.1, torch.rand(3) + 0.5
    refs = cpu.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, iters)
    poison()
    outs = triton_mhc.hc_mixes(trunk.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), 1e-6, 1e-6, iters)
    for o, r in zip(outs, refs, strict=True):
        assert o.dtype == torch.float32 and o.shape == r.shape
        assert rel_err(o, r) < 1e-5


@needs_triton
@pytest.mark.parametrize("t,m,h", [(16384, 4, 4096), (700, 3, 96), (5, 4, 4096)])
@pytest.mark.parametrize("read_dtype", [torch.bfloat16, torch.float32])
def test_hc_mixes_read(gpu, cpu, t, m, h, read_dtype):
    """A sub-layer's mixes and its input under the previous pre mix (one pass over a prefill's BF16 trunk;
    the two ops for a decode's few tokens) against the CPU reference."""
    trunk = (torch.randn(t, m, h) * 2).to(torch.bfloat16)
    fn = torch.randn((2 + m) * m, m * h) * (m * h) ** -0.5
    base, scale, w = torch.randn((2 + m) * m) * 0.1, torch.rand(3) + 0.5, torch.rand(t, m)
    refs = cpu.hc_mixes_read(trunk, fn, base, scale, 1e-6, 1e-6, 20, w, read_dtype)
    poison()
    dev = [a.to(DEV) for a in (trunk, fn, base, scale)]
    outs = gpu.hc_mixes_read(*dev, 1e-6, 1e-6, 20, w.to(DEV), read_dtype)
    for o, r in zip(outs[:3], refs[:3], strict=True):
        assert o.dtype == torch.float32 and o.shape == r.shape and rel_err(o, r) < 1e-5
    assert outs[3].dtype == read_dtype and outs[3].shape == (t, h)
    assert rel_err(outs[3], refs[3]) < tol(read_dtype)


@needs_triton
@pytest.mark.parametrize("t,m,h", [(512, 4, 4096), (16384, 4, 4096), (700, 3, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_mhc_projection_is_an_fp32_projection(t, m, h, dtype):
    """The prefill projection of a 16-bit trunk on the tensor cores (exact products of the trunk and fn's
    three TF32 parts) against the float64 projection, to FP32 accuracy; with the row sums of squares."""
    from deepinfer_model.backends.nvidia import triton_mhc

    trunk = (torch.randn(t, m, h) * 2).to(dtype)
    fn = torch.randn((2 + m) * m, m * h) * (m * h) ** -0.5
    flat = trunk.double().flatten(1)
    poison()
    z, ss = triton_mhc.project(trunk.to(DEV), fn.to(DEV))
    assert rel_err(z, flat @ fn.double().t()) < 1e-6
    assert rel_err(ss, flat.square().sum(1)) < 1e-6


@needs_triton
@pytest.mark.parametrize(
    "t,k,e,inter,hidden",
    [
        (1, 6, 16, 1024, 4096),
        (8, 6, 16, 1024, 4096),
        (40, 6, 16, 1024, 4096),
        (128, 6, 16, 1024, 4096),
        (3, 2, 5, 200, 320),
        (64, 4, 4, 96, 256),
    ],
)
@pytest.mark.parametrize("weight_before_down", [True, False])
def test_expert_swiglu(gpu, cpu, t, k, e, inter, hidden, weight_before_down):
    """The registry's op (Triton kernels for these pair counts) and the grouped-GEMM reference on the GPU,
    both against the CPU reference; the medium V4.1's expert shapes at decode batches 1 / 8 / 40."""
    from deepinfer_model.backends.nvidia import triton_moe

    assert t * k <= triton_moe.MAX_PAIRS  # (so the registry's op is the Triton path)
    bf = torch.bfloat16
    x = torch.randn(t, hidden).to(bf)
    w1, w3 = ((torch.randn(e, inter, hidden) * hidden**-0.5).to(bf) for _ in range(2))
    w2 = (torch.randn(e, hidden, inter) * inter**-0.5).to(bf)
    pairs = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).reshape(-1)
    ws = torch.rand(t * k)
    args = (1.5, weight_before_down)
    ref = cpu.expert_swiglu(x, pairs, ws, w1, w3, w2, *args)
    dev = [a.to(DEV) for a in (x, pairs, ws, w1, w3, w2)]
    for fn in (gpu.expert_swiglu, cpu.expert_swiglu):
        poison()
        out = fn(*dev, *args)
        assert out.dtype == torch.float32 and out.shape == (t * k, hidden)
        assert rel_err(out, ref) < tol(bf)


@pytest.mark.parametrize(
    "t,k,e,inter,hidden",
    [
        (1, 6, 16, 1024, 4096),  # decode: the few-pairs kernels, then the combine kernel
        (8, 6, 16, 1024, 4096),
        (300, 6, 16, 1024, 4096),  # prefill (> MAX_PAIRS pairs): grouped GEMMs, SwiGLU and combine kernels
        (3000, 6, 16, 256, 512),
        (300, 4, 5, 200, 320),  # ragged column blocks, an expert count that is not a power of two
    ],
)
@pytest.mark.parametrize("weight_before_down", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_expert_swiglu_sum(gpu, cpu, t, k, e, inter, hidden, weight_before_down, shared):
    """The per-token sum of the routed experts with the shared expert's addend (the op native mode's MoE
    calls) against the CPU reference, BF16 roundings into an FP32 carrier and into BF16."""
    bf = torch.bfloat16
    x = torch.randn(t, hidden).to(bf)
    w1, w3 = ((torch.randn(e, inter, hidden) * hidden**-0.5).to(bf) for _ in range(2))
    w2 = (torch.randn(e, hidden, inter) * inter**-0.5).to(bf)
    pairs = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).reshape(-1)
    ws = torch.rand(t * k)
    add = torch.randn(t, hidden).to(bf).float() if shared else None
    ref = cpu.expert_swiglu_sum(x, pairs, ws, w1, w3, w2, 1.5, weight_before_down, add, bf, torch.float32)
    dev = [None if a is None else a.to(DEV) for a in (x, pairs, ws, w1, w3, w2, add)]
    for out_dtype in (torch.float32, bf):
        poison()
        out = gpu.expert_swiglu_sum(*dev[:6], 1.5, weight_before_down, dev[6], bf, out_dtype)
        assert out.dtype == out_dtype and out.shape == (t, hidden)
        assert torch.equal(out.float(), out.float().bfloat16().float())  # rounded to BF16
        assert rel_err(out, ref) < tol(bf)


@needs_triton
@pytest.mark.parametrize("t,n,block", [(16384, 8192, 16), (7, 1500, 16), (3, 3000, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_max(gpu, cpu, t, n, block, dtype):
    """The candidate blocks' maxima and the rows' valid counts against the reference, bit for bit (a causal
    prefix with holes; rows with nothing valid)."""
    scores = (torch.randn(t, n) * 3).to(dtype)
    valid = (torch.arange(n)[None, :] < torch.randint(0, n + 1, (t, 1))) & (torch.rand(t, n) < 0.9)
    valid[0] = False
    ref = cpu.block_max(scores, valid, block)
    poison()
    got = gpu.block_max(scores.to(DEV), valid.to(DEV), block)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and torch.equal(g.cpu(), r)


@needs_triton
@pytest.mark.parametrize("shape", [(16384, 2048), (3, 5, 1000), (1, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu(gpu, cpu, shape, dtype):
    """The shared expert's activation (gate and up as the act-dtype GEMMs leave them) against the CPU
    reference; values up to the clamp limit and beyond, rounded once to the input dtype."""
    gate, up = ((torch.randn(shape) * 3).to(dtype) for _ in range(2))
    ref = cpu.swiglu(gate, up, 2.5)
    poison()
    out = gpu.swiglu(gate.to(DEV), up.to(DEV), 2.5)
    assert out.dtype == dtype and out.shape == gate.shape
    assert rel_err(out, ref) < tol(dtype)
    # (an FP32 output asked for: the reference's path, the same values before the rounding)
    assert rel_err(gpu.swiglu(gate.to(DEV), up.to(DEV), 2.5, torch.float32), ref) < tol(dtype)


@needs_triton
@pytest.mark.parametrize("t,n", [(8192, 16384), (7, 1500), (3, 65536)])
def test_topk_keys_and_selection(gpu, cpu, t, n):
    """The top-k keys kernel against the reference bit for bit, and the selection it feeds against the
    whole-row sort (ties from few distinct values, both zeros, a causal prefix mask)."""
    from deepinfer_model.layers.indexer import _select_topk_sorted, select_topk

    pool = torch.tensor([0.0, -0.0, 1.5, -1.5, 3.0, 1e-3, -7.0, 0.25])
    scores = (
        pool[torch.randint(0, len(pool), (t, n))] + torch.randn(t, n) * (torch.rand(t, 1) < 0.5)
    ).bfloat16()
    valid = torch.arange(n)[None, :] < torch.randint(0, n + 1, (t, 1))
    poison()
    keys = gpu.topk_keys(scores.to(DEV), valid.to(DEV))
    assert torch.equal(keys.cpu(), cpu.topk_keys(scores, valid))
    picked = select_topk(scores.to(DEV), valid.to(DEV), 512)  # (through the `topk_indices` op)
    assert torch.equal(picked.cpu(), _select_topk_sorted(scores, valid, 512))
    for k in (1, 64, n + 3):  # (k above n: padded with -1)
        poison()
        got = gpu.topk_indices(scores.to(DEV), valid.to(DEV), k)
        assert torch.equal(got.cpu(), cpu.topk_indices(scores, valid, k))


@needs_triton
@pytest.mark.parametrize("p,e", [(1, 16), (48, 16), (256, 256), (300, 16), (2000, 64)])
def test_expert_pair_sort(p, e):
    """The one-program counting sort (and, past its tile, argsort) against torch's stable sort."""
    from deepinfer_model.backends.nvidia import triton_moe

    pairs = torch.randint(0, e, (p,), device=DEV)
    poison()
    order, ends = triton_moe.sort_pairs(pairs, e)
    ref = torch.argsort(pairs, stable=True)
    assert torch.equal(order, ref)
    assert torch.equal(ends, torch.searchsorted(pairs[ref], torch.arange(e, device=DEV), right=True).int())


_BF, _F32 = torch.bfloat16, torch.float32


@needs_triton
@pytest.mark.parametrize(
    "t,m,h",
    [
        (1, 4, 4096),  # a decode step of the medium V4.1
        (4097, 4, 4096),  # a prefill chunk: one token per program
        (333, 4, 7168),  # the full V4.1 width (a padded row tile of 8192)
        (37, 4, 256),  # 16 tokens per program, T not a multiple of them
        (50, 3, 200),
    ],
)
@pytest.mark.parametrize(
    "dtype,kv_dtype,act,out_dtype",
    [
        (_BF, _BF, _BF, _BF),  # native BF16: narrow trunk, keys and values (the model's prefill and decode)
        (_F32, _BF, _BF, _F32),  # a trunk in the FP32 carrier (an Engram layer fed by the embedding)
        (_F32, _F32, _F32, _F32),  # FP32 activations
    ],
)
def test_engram_gate(gpu, cpu, monkeypatch, t, m, h, dtype, kv_dtype, act, out_dtype):
    """Engram's gate and update in native mode (the Triton kernel, `triton_engram.py`) against the CPU reference
    in the same mode: k and v as strided views of one projection's rows, image rows copied, outputs rounded to
    the act dtype."""
    from deepinfer_model.backends.nvidia import triton_engram

    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    trunk = (torch.randn(t, m, h) * 2).to(act).to(dtype)
    kv, half = torch.randn(t, (m + 1) * h), t // 2
    # keys aligned with or opposed to their trunk rows on half the tokens: large gates of both signs
    signs = torch.sign(torch.randn(half, m, 1))
    kv[:half, : m * h] += (3 * signs * trunk[:half].float()).reshape(half, m * h)
    kv = kv.to(act).to(kv_dtype)
    qk = (1 + 0.1 * torch.randn(m, h)).bfloat16().float() * (1 + 0.1 * torch.randn(m, h)).bfloat16().float()
    image = torch.rand(t) < 0.25
    image[0], image[-1] = t > 1, False
    k, v = kv[:, : m * h].view(t, m, h), kv[:, m * h :]
    ref = cpu.engram_gate(trunk, k, v, qk, image, 1e-6, act, out_dtype)
    dkv = kv.to(DEV)
    dev = (trunk.to(DEV), dkv[:, : m * h].view(t, m, h), dkv[:, m * h :], qk.to(DEV), image.to(DEV))
    assert triton_engram.supports(*dev[:3], act, out_dtype)
    poison()
    out = gpu.engram_gate(*dev, 1e-6, act, out_dtype)
    assert out.dtype == out_dtype and out.shape == (t, m, h)
    assert rel_err(out, ref) < tol(act)
    got = out.cpu()
    assert torch.equal(got[image], trunk[image].to(out_dtype))
    assert torch.equal(got.float(), got.float().to(act).float())  # rounded to the act dtype
    if act == _BF:  # a gate that differs in its last FP32 bits flips a BF16 rounding only rarely
        assert float((got[~image] != ref[~image]).double().mean()) < 0.01
    # the registry ran the kernel
    assert torch.equal(out, triton_engram.engram_gate(*dev, 1e-6, act, out_dtype))


@needs_tilelang
def test_hc_mixes_single_sinkhorn_iteration(cpu):
    trunk = torch.randn(7, 4, 256)
    fn, base, scale = torch.randn(24, 1024) * 0.03, torch.randn(24) * 0.1, torch.rand(3) + 0.5
    refs = cpu.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, 1)
    outs = tilelang_mhc.hc_mixes(trunk.to(DEV), fn.to(DEV), base.to(DEV), scale.to(DEV), 1e-6, 1e-6, 1)
    for o, r in zip(outs, refs, strict=True):
        assert rel_err(o, r) < 1e-5


@needs_tilelang
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tilelang_rms_norm_fp64_carrier_with_out_dtype(cpu, dtype):
    x = (torch.randn(9, 1536) * 3).to(dtype)
    w = torch.randn(1536)
    out = tilelang_norm.rms_norm(x.double().to(DEV), w.to(DEV), 1e-6, out_dtype=dtype)
    assert out.dtype == dtype and rel_err(out, cpu.rms_norm(x, w, 1e-6)) < tol(dtype)


def test_no_tilelang_kernel_fell_back_to_torch(gpu):
    """Runs last in this file: every registry call above went to the TileLang kernels."""
    assert TILELANG_FALLBACKS == {}, TILELANG_FALLBACKS


@pytest.mark.skipif(
    importlib.util.find_spec("tile_kernels") is None, reason="needs tile_kernels (TileKernels)"
)
@pytest.mark.parametrize("t,k", [(1, 512), (64, 4096), (257, 7168)])
def test_tile_kernels_activation_quant_equals_torch(t, k):
    """TileKernels' per_token_cast with power-of-two scales is the same quantisation as ours, bit for bit."""
    from deepinfer_model.backends.nvidia import gemm

    x = (torch.randn(t, k) * torch.logspace(-2, 2, t)[:, None]).to(torch.bfloat16).to(DEV)
    q_ref, s_ref = gemm.quant_act_fp8(x)
    poison()
    q, s = gemm.quant_act_fp8_tile_kernels(x)
    assert s.shape == s_ref.shape and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
