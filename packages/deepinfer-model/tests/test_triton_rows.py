"""The Triton row kernels of batch-invariant mode on CUDA (`backends/nvidia/triton_rows.py`).

Each check compares with a float64 naive product (error within the accumulator's rounding) and asserts the
property the mode relies on: a row's bits are the same whatever the number of rows and the row's index,
and a row of the per-expert kernel is bitwise the shared-weight kernel's row. Outputs are poisoned first
(see test_ops_nvidia.py), so an unwritten element shows up as NaN.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from deepinfer_model.backends.nvidia import triton_rows  # noqa: E402

DEV = torch.device("cuda")
ROW_COUNTS = (1, 2, 3, 8, 17, 100, 1000)


def poison() -> None:
    big = [torch.full((256 << 20,), 0xFF, dtype=torch.uint8, device=DEV) for _ in range(2)]
    del big


def _rows_stay_equal(fn, x: torch.Tensor) -> None:
    """fn(x[lo:hi], lo) equals the rows lo..hi of fn(x, 0) bitwise, for several counts and offsets."""
    full = fn(x, 0)
    assert bool(torch.isfinite(full).all())
    for m in ROW_COUNTS:
        for lo in {0, 1, x.shape[0] - m}:
            if 0 <= lo and lo + m <= x.shape[0]:
                poison()
                assert torch.equal(fn(x[lo : lo + m].contiguous(), lo), full[lo : lo + m]), (m, lo)


@pytest.mark.parametrize(
    "k,n,w_dtype",
    [
        (256, 1000, torch.float32),
        (4096, 129, torch.float32),
        (1024, 512, torch.bfloat16),
        (128, triton_rows.WIDE_N + 77, torch.bfloat16),  # the wide blocks of an LM head
    ],
)
def test_rows_matmul_fp64(k, n, w_dtype):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(1000, k, generator=g, dtype=torch.float64).to(DEV)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(w_dtype).to(DEV)
    out = triton_rows.rows_matmul(x, w)
    naive = x @ w.double().t()
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, naive, rtol=1e-11, atol=1e-11)
    _rows_stay_equal(lambda a, lo: triton_rows.rows_matmul(a, w), x)


def test_rows_matmul_fp32_mixes_projection():
    """The mHC projection's shape ([T, 4H] x [4H, 24]) in FP32, and the row statistic next to it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, 4 * 2048, generator=g).to(DEV)
    fn = (torch.randn(24, 4 * 2048, generator=g) * 0.01).to(DEV)
    out = triton_rows.rows_matmul(x, fn)
    naive = x.double() @ fn.double().t()
    assert out.dtype == torch.float32
    assert float((out.double() - naive).norm() / naive.norm()) < 1e-5
    _rows_stay_equal(lambda a, lo: triton_rows.rows_matmul(a, fn), x)
    sq = triton_rows.row_sum_squares(x)
    torch.testing.assert_close(sq.double(), x.double().square().sum(-1), rtol=1e-5, atol=0)
    _rows_stay_equal(lambda a, lo: triton_rows.row_sum_squares(a), x)


def test_pair_rows_are_the_shared_weight_rows():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(6, 300, 512, generator=g) * 0.05).to(DEV)  # [E, N, K] stored FP32
    x = torch.randn(200, 512, generator=g, dtype=torch.float64).to(DEV)
    pairs = torch.randint(0, 6, (200,), generator=g).to(DEV)
    got = triton_rows.pair_rows_matmul(x, w, pairs)
    for e in range(6):
        rows = (pairs == e).nonzero().flatten()
        if len(rows):
            assert torch.equal(got[rows], triton_rows.rows_matmul(x[rows], w[e]))
    _rows_stay_equal(lambda a, lo: triton_rows.pair_rows_matmul(a, w, pairs[lo : lo + a.shape[0]]), x[:17])


def _rounding_cases() -> torch.Tensor:
    """FP64 values that probe the FP64 -> FP32 -> 16-bit roundings torch applies: ties of BF16 / FP16 with
    and without bits below FP32's precision (1 + 2^-8 + 2^-30 rounds up straight to BF16 but to 1 through
    FP32, as torch rounds), FP32 / BF16 / FP16 subnormals, values past each type's largest finite, signs."""
    t = 2.0**-30
    special = [1 + 2**-8, 1 + 2**-8 + t, 1 + 3 * 2**-8, 1 + 3 * 2**-8 - t, 1 + 2**-11, 1 + 2**-11 + t,
               1 + 2**-24, 1 + 2**-24 + 2**-52, 1 + 3 * 2**-24, 2.0**-130, 3 * 2.0**-149 / 2, 2.0**-140,
               2.0**-20, 6.1e-5, 6e-8, 3.0e-8, 65504.0, 65520.0, 65519.99, 3.4e38, 3.4028235e38 * (1 + 2**-25),
               3.5e38, 1e300, 0.0, 1.0, 0.1, 1 / 3]  # fmt: skip
    values = torch.tensor(special, dtype=torch.float64)
    return torch.cat((values, -values))


@pytest.mark.parametrize("round_to", [torch.float32, torch.bfloat16, torch.float16])
def test_rounding_in_the_kernel_is_torchs(round_to):
    """`round_to=`: every output value bitwise what `.to(round_to).to(x.dtype)` gives, on values placed at
    the roundings' edges (an identity x picks one weight entry per output: the sum is that entry exactly)
    and on random products, for FP64 and FP32 rows, shared and per-expert weights."""
    cases = _rounding_cases()
    w = cases.view(-1, 1).repeat(1, 3).to(DEV)  # [N, 3]: row j holds case j three times
    x = torch.zeros(3, 3, dtype=torch.float64, device=DEV)
    x[0, 0] = x[1, 1] = x[2, 2] = 1.0
    g = torch.Generator().manual_seed(11)
    xr = torch.randn(40, 300, generator=g, dtype=torch.float64).to(DEV)
    wr = torch.randn(3, 513, 300, generator=g).to(DEV)
    pairs = torch.randint(0, 3, (40,), generator=g).to(DEV)
    for a, b in ((x, w), (xr, wr[1]), (xr.float(), wr[2])):
        poison()
        got = triton_rows.rows_matmul(a, b, round_to)
        want = triton_rows.rows_matmul(a, b).to(round_to).to(a.dtype)
        assert got.dtype == a.dtype and torch.equal(got, want), (a.dtype, round_to)
    poison()
    got = triton_rows.pair_rows_matmul(xr, wr, pairs, round_to)
    assert torch.equal(got, triton_rows.pair_rows_matmul(xr, wr, pairs).to(round_to).to(torch.float64))
    with pytest.raises(ValueError, match="round_to"):
        triton_rows.rows_matmul(xr, wr[0], torch.float64)


def test_rows_matmul_rejects_bad_operands():
    x = torch.randn(3, 8, device=DEV)
    with pytest.raises(ValueError, match="rows_matmul"):
        triton_rows.rows_matmul(x, torch.randn(4, 9, device=DEV))
    with pytest.raises(ValueError, match="float64 or float32"):
        triton_rows.rows_matmul(x.half(), torch.randn(4, 8, device=DEV))
    assert triton_rows.rows_matmul(x[:0], torch.randn(4, 8, device=DEV)).shape == (0, 4)


def test_registry_serves_the_row_kernels():
    from deepinfer_model.ops import get_ops

    ops = get_ops("nvidia")
    assert ops.sources["rows_matmul"] == "nvidia" and ops.sources["pair_rows_matmul"] == "nvidia"


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")
def test_tilelang_mixes_are_row_invariant_in_batch_invariant_mode(monkeypatch):
    from deepinfer_model.backends.nvidia import tilelang_mhc
    from deepinfer_model.ops import get_ops

    g = torch.Generator().manual_seed(3)
    m, h = 4, 1024
    trunk = torch.randn(64, m, h, generator=g).to(DEV)
    fn = (torch.randn((2 + m) * m, m * h, generator=g) * (m * h) ** -0.5).to(DEV)
    base, scale = (
        (torch.randn((2 + m) * m, generator=g) * 0.1).to(DEV),
        (torch.rand(3, generator=g) + 0.5).to(DEV),
    )
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    full = tilelang_mhc.hc_mixes(trunk, fn, base, scale, 1e-6, 1e-6, 20)
    refs = get_ops("cpu").hc_mixes(trunk.cpu(), fn.cpu(), base.cpu(), scale.cpu(), 1e-6, 1e-6, 20)
    for o, r in zip(full, refs, strict=True):
        assert float((o.double().cpu() - r.double()).norm() / r.double().norm()) < 1e-5
    for lo, cnt in ((0, 1), (5, 1), (3, 8), (63, 1)):
        part = tilelang_mhc.hc_mixes(trunk[lo : lo + cnt], fn, base, scale, 1e-6, 1e-6, 20)
        for a, b in zip(part, full, strict=True):
            assert torch.equal(a, b[lo : lo + cnt]), (lo, cnt)


@pytest.mark.parametrize("m,k,n", [(8, 128, 32), (8, 32, 129), (8, 512, 32), (8, 32, 513), (5, 40, 7)])
def test_tile_bmm_products_do_not_depend_on_their_neighbours(m, k, n):
    """The attention tiles' shapes: every product within FP64 rounding of torch.bmm, and bitwise the same
    alone, among 1000 others, gathered by index, or against a broadcast matrix."""
    g = torch.Generator().manual_seed(m * k + n)
    a = torch.randn(1000, m, k, generator=g, dtype=torch.float64).to(DEV)
    b = torch.randn(1000, k, n, generator=g, dtype=torch.float64).to(DEV)
    full = triton_rows.tile_bmm(a, b)
    torch.testing.assert_close(full, torch.bmm(a, b), rtol=1e-12, atol=1e-12)
    _rows_stay_equal(lambda x, lo: triton_rows.tile_bmm(x, b[lo : lo + x.shape[0]].contiguous()), a)
    ia = torch.randint(0, 1000, (300,), generator=g).to(DEV)
    ib = torch.randint(0, 1000, (300,), generator=g).to(DEV)
    poison()
    assert torch.equal(triton_rows.tile_bmm(a, b, ia, ib), triton_rows.tile_bmm(a[ia], b[ib]))
    shared = b[:1].expand(1000, -1, -1)
    assert torch.equal(
        triton_rows.tile_bmm(a, shared)[7:9], triton_rows.tile_bmm(a[7:9], b[:1].expand(2, -1, -1))
    )
    assert torch.equal(triton_rows.tile_bmm(a[3:4], b[:1]), triton_rows.tile_bmm(a, shared)[3:4])


def test_direct_launches_give_the_jit_launch_bits():
    """Repeated launches skip the JIT's binding (triton_launch.DirectLaunch): they are taken, and every
    kernel gives bitwise what a launch through the JIT gives (a fresh launcher with the direct path off)."""
    from deepinfer_model.backends.nvidia.triton_launch import DirectLaunch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 300, generator=g, dtype=torch.float64).to(DEV)
    w = torch.randn(129, 300, generator=g).to(DEV)
    a = torch.randn(50, 8, 32, generator=g, dtype=torch.float64).to(DEV)
    b = torch.randn(50, 32, 129, generator=g, dtype=torch.float64).to(DEV)
    idx = torch.randint(0, 50, (70,), generator=g).to(DEV)
    calls = {
        "_ROWS": lambda: triton_rows.rows_matmul(x, w),
        "_TILES": lambda: triton_rows.tile_bmm(a, b, idx, idx.flip(0)),
        "_SUMSQ": lambda: triton_rows.row_sum_squares(x.float()),
    }
    for name, call in calls.items():
        launcher = getattr(triton_rows, name)
        call()  # compiled (or found) through the JIT, then kept
        before = launcher.direct_launches
        poison()
        direct = call()
        assert launcher.direct_launches == before + 1, name
        jit_only = DirectLaunch(launcher.fn)
        jit_only.enabled = False
        setattr(triton_rows, name, jit_only)
        try:
            poison()
            assert torch.equal(call(), direct), name
        finally:
            setattr(triton_rows, name, launcher)
    # a new variant (other dtypes) is compiled through the JIT, not served by another one's kernel
    fresh = DirectLaunch(triton_rows._rows_kernel)
    launcher, triton_rows._ROWS = triton_rows._ROWS, fresh
    try:
        wide = triton_rows.rows_matmul(x, w)
        narrow = triton_rows.rows_matmul(x.float(), w)
        assert fresh.direct_launches == 0 and narrow.dtype == torch.float32
        assert torch.equal(triton_rows.rows_matmul(x, w), wide) and fresh.direct_launches == 1
    finally:
        triton_rows._ROWS = launcher
    ref = x.float().double() @ w.double().t()
    assert torch.allclose(narrow.double(), ref, rtol=1e-4, atol=1e-4)
