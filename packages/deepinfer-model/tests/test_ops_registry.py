"""The op registry on the CPU: backend selection, fallbacks, and the CPU entries against naive references."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from deepinfer_model.ops import (
    OP_SPECS,
    get_ops,
    pack_fp8_tokens,
    register,
    resolve_backend,
    unpack_fp8_tokens,
)
from deepinfer_model.ops import registry as reg
from deepinfer_model.ops.kv_format import store_fp8_tokens
from deepinfer_model.quant import fake_quant_fp8, quant_fp8_block


def test_env_selects_cpu(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    assert resolve_backend() == "cpu"
    assert get_ops().backend == "cpu"


def test_the_default_backend_is_read_once_per_model_step(monkeypatch):
    """Within `numerics.resolved()` (a model step) get_ops() serves the accelerator read at the step's start;
    outside one it follows the environment at every call; an explicit backend never depends on it."""
    from deepinfer_model import numerics

    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    with numerics.resolved():
        monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
        assert get_ops().backend == "cpu"
        with numerics.resolved(), pytest.raises(ValueError, match="reserved"):  # a nested step re-reads it
            get_ops()
        assert get_ops().backend == "cpu"
    assert reg._PINNED.value is None
    with pytest.raises(ValueError, match="reserved"):
        get_ops()
    assert get_ops("cpu").backend == "cpu"


@pytest.mark.parametrize("value", ["cuda", "gpu", "tpu"])
def test_unknown_accelerator_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", value)
    with pytest.raises(ValueError, match="DEEPINFER_ACCELERATOR must be one of"):
        resolve_backend()


def test_ascend_is_reserved(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with pytest.raises(ValueError, match="reserved"):
        resolve_backend()


def test_explicit_nvidia_without_cuda_raises(monkeypatch):
    monkeypatch.setattr(reg, "_cuda_available", lambda: False)
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        resolve_backend()


def test_nvidia_build_without_cuda_falls_back_with_a_log_line(monkeypatch, caplog):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    monkeypatch.setattr(reg, "_cuda_available", lambda: False)
    monkeypatch.setattr(reg, "_build_accelerator", lambda: "nvidia")
    with caplog.at_level(logging.WARNING, logger="deepinfer_model.ops"):
        assert resolve_backend() == "cpu"
    assert "no CUDA device" in caplog.text


def test_cpu_table_covers_every_op():
    table = get_ops("cpu")
    assert set(table.sources) == set(OP_SPECS)
    assert set(table.sources.values()) == {"cpu"}
    with pytest.raises(AttributeError, match="not implemented"):
        _ = table.no_such_op


def test_register_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown op"):
        register("cpu", "no_such_op")
    with pytest.raises(ValueError, match="backend must be one of"):
        register("tpu", "rms_norm")


def test_kv_pack_matches_fake_quant_and_layout():
    x = torch.randn(37, 512) * torch.logspace(-3, 2, 37)[:, None]
    packed = pack_fp8_tokens(x)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 528)
    torch.testing.assert_close(unpack_fp8_tokens(packed), fake_quant_fp8(x, 32), rtol=0, atol=0)
    # scales are UE8M0 bytes after the data: byte 512 + g holds the exponent of group g
    amax = x[:, :32].abs().amax(-1)
    assert bool(((2.0 ** (packed[:, 512].float() - 127)) * 448 >= amax).all())


def test_kv_store_writes_only_its_slots_and_validates():
    cache = torch.zeros(3, 4, 1, 528, dtype=torch.uint8)
    lat = torch.randn(2, 512)
    store_fp8_tokens(lat, cache, torch.tensor([5, 11]))
    flat = cache.view(12, 528)
    torch.testing.assert_close(unpack_fp8_tokens(flat[[5, 11]]), fake_quant_fp8(lat, 32), rtol=0, atol=0)
    assert int(flat[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10]].count_nonzero()) == 0
    with pytest.raises(ValueError, match="slots must lie in"):
        store_fp8_tokens(lat, cache, torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="latent must be"):
        store_fp8_tokens(torch.randn(2, 64), cache, torch.tensor([0, 1]))


def test_cpu_fp8_block_linear_close_to_exact_product():
    torch.manual_seed(0)
    x = torch.randn(9, 256).to(torch.bfloat16)
    w, s = quant_fp8_block(torch.randn(384, 256) * 0.05, (128, 128))
    out = get_ops("cpu").fp8_block_linear(x, w, s.float() if s.dtype != torch.float8_e8m0fnu else s)
    wd = w.double() * (2.0 ** (s.view(torch.uint8).double() - 127)).repeat_interleave(
        128, 0
    ).repeat_interleave(128, 1)
    exact = x.double() @ wd.t()
    assert out.dtype == torch.bfloat16 and out.shape == (9, 384)
    rel = (out.double() - exact).norm() / exact.norm()
    assert rel < 3e-2  # activation FP8 quantisation noise only (weights are exactly dequantised)


def _naive_sink_decode(q, keys_by_row, sinks, scale):
    b, h, d = q.shape
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        k = keys_by_row[i]
        for j in range(h):
            if k.shape[0] == 0:
                continue
            s = (k @ q[i, j].double()) * scale
            m = max(float(s.max()), float(sinks[j]))
            e = torch.exp(s - m)
            out[i, j] = (e[:, None] * k).sum(0) / (e.sum() + math.exp(float(sinks[j]) - m))
    return out


def test_cpu_sparse_decode_matches_naive_loop():
    torch.manual_seed(1)
    blocks, page, b, h, k = 4, 16, 3, 4, 8
    lat = torch.randn(blocks * page, 512)
    cache = torch.zeros(blocks, page, 1, 528, dtype=torch.uint8)
    store_fp8_tokens(lat, cache, torch.arange(blocks * page))
    idx = torch.randint(0, blocks * page, (b, k), dtype=torch.int32)
    idx[1, 5:] = -1
    idx[2, :] = -1  # a query with no key returns zeros
    q = torch.randn(b, h, 512).to(torch.bfloat16)
    sinks = torch.randn(h)
    out = get_ops("cpu").sparse_decode_attention(q, cache, idx, sinks, 512**-0.5)
    deq = fake_quant_fp8(lat, 32).double()
    rows = [deq[idx[i][idx[i] >= 0].long()] for i in range(b)]
    ref = _naive_sink_decode(q, rows, sinks, 512**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    assert int(out[2].count_nonzero()) == 0


def test_models_route_hot_ops_through_the_cpu_registry(monkeypatch, tmp_path):
    """The V4.1 and V4 forwards call rms_norm / RoPE / mHC through `get_ops("cpu")` on CPU tensors, and
    the registry path is the reference: swapping one entry for a perturbed one changes the logits."""
    from deepinfer_model import load_model
    from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
    from deepinfer_model.testing import make_checkpoint, tiny_config

    table = get_ops("cpu")
    calls: dict[str, int] = {}
    for name in ("rms_norm", "apply_rope", "hc_mixes", "hc_mixes_read", "hc_read", "hc_write", "engram_gate"):
        fn = table[name]

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)

        monkeypatch.setattr(table, name, counted)
    ids = torch.randint(4, 128, (12,), generator=torch.Generator().manual_seed(0))
    v41 = load_v41(make_v41_checkpoint(tmp_path / "v41", seed=0))
    ref41 = v41.forward(ids).logits
    v4 = load_model(make_checkpoint(tmp_path / "v4", tiny_config(), seed=3, tokenizer=False))
    ref4 = v4.forward(ids)
    layers41, layers4 = v41.config.num_hidden_layers, v4.config.num_hidden_layers
    # (V4.1's sub-layers take the mixes with their read, `hc_mixes_read`; V4's the two ops)
    assert calls.get("hc_mixes", 0) + calls.get("hc_mixes_read", 0) >= 2 * (layers41 + layers4)
    assert calls["hc_mixes_read"] >= 2 * layers41
    assert calls["hc_write"] >= 2 * (layers41 + layers4)
    assert calls["rms_norm"] > 0 and calls["apply_rope"] > 0 and calls["hc_read"] > 0
    assert calls["engram_gate"] == len(v41.config.engram.layer_ids) > 0  # (V4 has no Engram)
    # a perturbed registry entry reaches the logits: the models really compute through the table
    monkeypatch.setattr(
        table, "rms_norm", lambda x, w, eps, out_dtype=None: torch.zeros_like(x, dtype=out_dtype)
    )
    assert not torch.equal(v41.forward(ids).logits, ref41)
    assert not torch.equal(v4.forward(ids), ref4)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_cpu_entries_take_the_fp64_carrier_with_out_dtype(act):
    """FP64 inputs holding act-dtype values with `out_dtype=act` equal the act-dtype inputs' results."""
    from deepinfer_model.config import RopeSpec
    from deepinfer_model.layers.rope import cos_sin

    ops = get_ops("cpu")
    x = (torch.randn(5, 3, 64) * 3).to(act)
    w = torch.rand(64) + 0.5
    assert torch.equal(ops.rms_norm(x.double(), w, 1e-6, out_dtype=act), ops.rms_norm(x, w, 1e-6))
    cos, sin = cos_sin(RopeSpec(dim=16, theta=10000.0), torch.arange(5))
    got = ops.apply_rope(x.double(), cos, sin, True, out_dtype=act)
    assert got.dtype == act and torch.equal(got, ops.apply_rope(x, cos, sin, True))
    with pytest.raises(ValueError, match="output\\) dtype must be float32 or bfloat16"):
        ops.rms_norm(x.double(), w, 1e-6)


_ROPE_CASES = [  # (x shape, rope dim): a V4.1 query / output, an index query, a latent, all channels, one row
    ((9, 8, 512), 64),
    ((5, 4, 128), 64),
    ((7, 512), 64),
    ((3, 2, 32), 32),
    ((1, 1, 70), 6),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,rope", _ROPE_CASES)
@pytest.mark.parametrize("inverse", [False, True])
def test_in_place_rope_is_the_out_of_place_result_bitwise(monkeypatch, dtype, shape, rope, inverse):
    """`apply_rope_` writes `apply_rope`'s tail into x bit for bit and leaves the leading channels alone: the
    cpu reference, the NVIDIA backend's torch version (plain torch, run here) and its fallback through the
    registered `apply_rope` (here its torch version: no kernel launch on this host)."""
    from deepinfer_model.backends import nvidia
    from deepinfer_model.backends.nvidia import torch_cuda

    monkeypatch.setitem(nvidia._ROW_LOCAL, "apply_rope", torch_cuda.apply_rope)
    from deepinfer_model.config import RopeSpec
    from deepinfer_model.layers.rope import cos_sin

    x = (torch.randn(shape) * 4).to(dtype)
    cos, sin = cos_sin(RopeSpec(dim=rope, theta=10000.0), torch.arange(shape[0]) * 37 + 5)
    lead = shape[-1] - rope
    for out_of_place, in_place in (
        (get_ops("cpu").apply_rope, get_ops("cpu").apply_rope_),
        (torch_cuda.apply_rope, torch_cuda.apply_rope_),
        (torch_cuda.apply_rope, nvidia._rope_tail_via_copy),
    ):
        want = out_of_place(x, cos, sin, inverse)
        got = x.clone()
        assert in_place(got, cos, sin, inverse) is None
        assert want.dtype == dtype and torch.equal(got, want)
        assert torch.equal(got[..., :lead], x[..., :lead])
    ref = get_ops("cpu").apply_rope(x.double(), cos, sin, inverse, out_dtype=dtype)  # the model's carrier
    got = x.clone()
    get_ops("cpu").apply_rope_(got, cos, sin, inverse)
    assert torch.equal(got, ref)


def test_in_place_rope_rejects_what_it_cannot_rotate_in_place():
    ops = get_ops("cpu")
    x = torch.randn(4, 3, 64)
    cos, sin = torch.rand(4, 8), torch.rand(4, 8)
    for bad, match in (
        (x.transpose(0, 1), "x must be contiguous"),
        (x[..., :48], "x must be contiguous"),
        (x.double(), "x must be float32 or bfloat16"),
        (x.half(), "x must be float32 or bfloat16"),
        (x[0, 0], "x must be \\[T, ..., C\\]"),
    ):
        before = bad.clone()
        with pytest.raises(ValueError, match=f"apply_rope_: {match}"):
            ops.apply_rope_(bad, cos, sin)
        assert torch.equal(bad, before)
    with pytest.raises(ValueError, match="apply_rope_: cos/sin must be \\[T=4, r/2\\] with r <= 64"):
        ops.apply_rope_(x, torch.rand(4, 40), torch.rand(4, 40))
    with pytest.raises(ValueError, match="cos/sin must be"):
        ops.apply_rope_(x, torch.rand(3, 8), torch.rand(3, 8))


@pytest.mark.parametrize(
    "numerics,act", [("native", torch.bfloat16), ("native", torch.float32), ("exact", torch.float32)]
)
def test_model_rope_rotates_in_place_only_where_it_may(monkeypatch, numerics, act):
    """`model_calls.rope(inplace=True)`: the result is x itself, rotated in place, exactly where the result
    has x's dtype (native: `narrow` BF16, or FP32 activations) and x is contiguous; the same values as the
    out-of-place call everywhere; a non-contiguous x, or a result in the FP64 carrier, leaves x untouched."""
    from deepinfer_model.ops import model_calls

    monkeypatch.setenv("DEEPINFER_NUMERICS", numerics)
    carrier = torch.float64 if numerics == "exact" else torch.float32
    cos, sin = torch.rand(6, 16), torch.rand(6, 16)
    for narrow in (False, True):
        base = (torch.randn(6, 4, 96) * 2).to(act)
        src = base if act != torch.float32 or numerics == "native" else base.to(carrier)
        want = model_calls.rope(src.clone(), cos, sin, act, True, narrow)
        x = src.clone()
        got = model_calls.rope(x, cos, sin, act, True, narrow, inplace=True)
        assert got.dtype == want.dtype and torch.equal(got, want)
        in_place = numerics == "native" and (act == torch.float32 or narrow)
        assert (got is x) == in_place
        assert torch.equal(x, want if in_place else src)
        strided = src.transpose(0, 1).contiguous().transpose(0, 1)  # src's values, not contiguous
        got = model_calls.rope(strided, cos, sin, act, True, narrow, inplace=True)
        assert got is not strided and torch.equal(got, want) and torch.equal(strided, src)


def test_failing_kernel_falls_back_to_torch_once_and_is_recorded(caplog):
    """A TileLang kernel that fails (compile/launch) is replaced by its torch version for good, logged and
    recorded; a ValueError about the inputs is the caller's error and propagates."""
    from deepinfer_model.backends import nvidia

    calls = {"kernel": 0, "torch": 0}

    def kernel(x):
        calls["kernel"] += 1
        if x < 0:
            raise ValueError("x must be >= 0")
        raise RuntimeError("nvcc failed")

    def torch_version(x):
        calls["torch"] += 1
        return x + 1

    fn = nvidia._kernel_or_torch("test_op", kernel, torch_version)
    with pytest.raises(ValueError, match="x must be"):
        fn(-1)
    assert "test_op" not in nvidia.TILELANG_FALLBACKS
    with caplog.at_level(logging.WARNING, logger="deepinfer_model.ops"):
        assert fn(1) == 2
    assert fn(2) == 3 and calls == {"kernel": 2, "torch": 2}
    assert "nvcc failed" in nvidia.TILELANG_FALLBACKS.pop("test_op") and "nvcc failed" in caplog.text


def test_kernel_wrapper_sends_unsupported_calls_to_the_reference():
    """With `supports`, the calls it rejects go to the reference without trying the kernel, and do not
    switch the wrapper: supported calls keep the kernel."""
    from deepinfer_model.backends import nvidia

    calls = []
    fn = nvidia._kernel_or_torch(
        "test_supported_op",
        lambda x, scale=1: calls.append("kernel") or x * scale,
        lambda x, scale=1: calls.append("reference") or -x,
        supports=lambda x, scale=1: x >= 0,
    )
    assert fn(3, scale=2) == 6 and fn(-3) == 3 and fn(4) == 4
    assert calls == ["kernel", "reference", "kernel"]
    assert "test_supported_op" not in nvidia.TILELANG_FALLBACKS


def test_batch_invariant_kernels_fall_back_only_before_their_first_success():
    """The batch-invariant GEMMs' wrappers fall back to the reference only when the kernel never ran (a
    compile error); a failure after a success (an out-of-memory) is raised, so a run never switches kernels
    (and bits) part-way."""
    from deepinfer_model.backends import nvidia

    state = {"fail": True}

    def kernel(x):
        if state["fail"]:
            raise RuntimeError("compile error")
        return "kernel"

    fn = nvidia._kernel_or_torch("test_bi_op", kernel, lambda x: "reference", True)
    assert fn(0) == "reference" and fn(0) == "reference"  # fell back for good before any success
    nvidia.TILELANG_FALLBACKS.pop("test_bi_op")
    state["fail"] = False
    fn = nvidia._kernel_or_torch("test_bi_op", kernel, lambda x: "reference", True)
    assert fn(0) == "kernel"
    state["fail"] = True
    with pytest.raises(RuntimeError, match="compile error"):
        fn(0)
    assert "test_bi_op" not in nvidia.TILELANG_FALLBACKS


def test_torch_fallbacks_are_served_by_the_reference_in_batch_invariant_mode(monkeypatch):
    """The NVIDIA backend's torch FP32 versions (used without TileLang, or after a kernel failed) reduce
    with torch / cuBLAS splits that follow the token count, so in batch-invariant mode the cpu reference
    serves them instead; outside the mode the torch version runs."""
    from deepinfer_model.backends import nvidia

    calls = []

    def torch_version(*args):
        calls.append(args)
        return "torch"

    fn = nvidia._reference_in_bi_mode("rms_norm", torch_version)
    x = torch.randn(3, 16, dtype=torch.float64).float().double()
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    assert fn(x, None, 1e-6, torch.float32) == "torch" and len(calls) == 1
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    got = fn(x, None, 1e-6, torch.float32)
    assert len(calls) == 1
    assert torch.equal(got, get_ops("cpu").rms_norm(x, None, 1e-6, torch.float32))


def test_rows_matmul_reference_is_row_invariant():
    """The cpu `rows_matmul` / `pair_rows_matmul` entries (the reference the NVIDIA Triton kernels
    replace): x @ weight.T within FP64 rounding of a float64 naive product, a row's bits the same at every
    batch size and row index, and a pair row bitwise the shared-weight row of its expert."""
    ops = get_ops("cpu")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 300, generator=g)  # [E, N, K] stored FP32
    x = torch.randn(37, 300, generator=g, dtype=torch.float64)
    full = ops.rows_matmul(x, w[1])
    naive = torch.einsum("mk,nk->mn", x, w[1].double())
    torch.testing.assert_close(full, naive, rtol=1e-12, atol=1e-12)
    for lo, hi in ((0, 1), (5, 6), (3, 12), (36, 37)):
        assert torch.equal(ops.rows_matmul(x[lo:hi], w[1]), full[lo:hi])
    pairs = torch.tensor([1, 0, 2, 1, 1])
    got = ops.pair_rows_matmul(x[:5], w, pairs)
    for p, e in enumerate(pairs.tolist()):
        assert torch.equal(got[p], ops.rows_matmul(x[p : p + 1], w[e])[0])
    with pytest.raises(ValueError, match="float64"):
        ops.pair_rows_matmul(x[:5].float(), w, pairs)


@pytest.mark.parametrize("round_to", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_matmul_reference_rounds_as_torch(round_to):
    """`round_to=` of the cpu row ops: the product rounded to that dtype and widened back to x.dtype (what
    the NVIDIA kernels must give bit for bit); any other dtype is refused by name."""
    ops = get_ops("cpu")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 40, 300, generator=g)
    x = torch.randn(9, 300, generator=g, dtype=torch.float64)
    got = ops.rows_matmul(x, w[0], round_to)
    assert got.dtype == torch.float64
    assert torch.equal(got, ops.rows_matmul(x, w[0]).to(round_to).double())
    assert not torch.equal(got, ops.rows_matmul(x, w[0]))  # (the rounding is applied)
    pairs = torch.tensor([2, 0, 1, 1, 0, 2, 2, 0, 1])
    assert torch.equal(
        ops.pair_rows_matmul(x, w, pairs, round_to), ops.pair_rows_matmul(x, w, pairs).to(round_to).double()
    )
    with pytest.raises(ValueError, match="round_to"):
        ops.rows_matmul(x, w[0], torch.int8)


def test_tile_bmm_reference():
    """The cpu `tile_bmm` (what batch-invariant attention tiles use where no kernel replaces it): torch.bmm
    per matrix, the indexed form gathering first, and both indices or neither."""
    ops = get_ops("cpu")
    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 8, 12, generator=g, dtype=torch.float64)
    b = torch.randn(5, 12, 7, generator=g, dtype=torch.float64)
    assert torch.equal(ops.tile_bmm(a, b, None, None), torch.bmm(a, b))
    ia, ib = torch.tensor([4, 0, 4]), torch.tensor([1, 1, 3])
    assert torch.equal(ops.tile_bmm(a, b, ia, ib), torch.bmm(a[ia], b[ib]))
    with pytest.raises(ValueError, match="both index tensors"):
        ops.tile_bmm(a, b, ia, None)


def test_compiled_regions_trace_the_registered_torch_version_of_an_op():
    """An op with a registered torch version runs its kernel eagerly and the torch version inside a compiled
    region (one graph instead of a graph break per call); other accelerator ops stay opaque calls there. The
    NVIDIA table registers the ops DEEPINFER_COMPILE_TRACED_OPS names. Built on this CPU host: the kernels are
    never launched."""
    from deepinfer_cluster import envs
    from deepinfer_model.backends import nvidia
    from deepinfer_model.compile_boundary import outside_compiled_graph

    table = reg.OpTable("nvidia")
    traced = set(envs.DEEPINFER_COMPILE_TRACED_OPS)  # (apply_rope brings apply_rope_)
    assert set(table.traced) == traced | ({"apply_rope_"} if "apply_rope" in traced else set())
    for name in envs.DEEPINFER_COMPILE_TRACED_OPS:
        assert table.traced[name] is nvidia._TORCH[name]
    calls = []

    def kernel(x):
        calls.append("kernel")
        return x + 2

    def traced(x):
        calls.append("traced")
        return x + 1

    op = outside_compiled_graph(kernel, traced)  # (how OpTable wraps an op with a registered torch version)
    x = torch.zeros(3)
    assert torch.equal(op(x), x + 2) and calls == ["kernel"]
    compiled = torch.compile(lambda t: op(t) * 3, backend="eager", fullgraph=True)  # no graph break
    assert torch.equal(compiled(x), (x + 1) * 3) and calls == ["kernel", "traced"]
    assert table.sources["rms_norm"] == "nvidia"


def test_unknown_traced_op_names_are_a_clear_error(monkeypatch):
    """Importing the backend reads no switch; building its table rejects a bad one, naming the choices."""
    monkeypatch.setenv("DEEPINFER_COMPILE_TRACED_OPS", "rms_norm,softmax")
    import deepinfer_model.backends.nvidia  # noqa: F401

    with pytest.raises(ValueError) as err:
        reg.OpTable("nvidia")
    assert (
        "DEEPINFER_COMPILE_TRACED_OPS must be a comma list of rms_norm, apply_rope, hc_read, hc_write "
        "(empty: none), got 'rms_norm,softmax'" in str(err.value)
    )


@pytest.mark.parametrize("value", ["-1", "many"])
def test_bad_triton_moe_pair_limit_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("DEEPINFER_TRITON_MOE_MAX_PAIRS", value)
    with pytest.raises(ValueError) as err:
        reg.OpTable("nvidia")
    assert f"DEEPINFER_TRITON_MOE_MAX_PAIRS must be an integer >= 0, got {value!r}" in str(err.value)


def test_rebuilding_the_table_applies_a_changed_kernel_switch(monkeypatch):
    """The NVIDIA kernels are chosen when a table is built, not when the backend is imported: the traced
    ops follow DEEPINFER_COMPILE_TRACED_OPS of the build, and `reset_tables` + `get_ops` rebuilds."""
    from deepinfer_model.backends import nvidia

    monkeypatch.delenv("DEEPINFER_COMPILE_TRACED_OPS", raising=False)
    assert reg.OpTable("nvidia").traced == {}
    monkeypatch.setenv("DEEPINFER_COMPILE_TRACED_OPS", "rms_norm,apply_rope")
    table = reg.OpTable("nvidia")
    assert table.traced == {
        "rms_norm": nvidia._TORCH["rms_norm"],
        "apply_rope": nvidia._TORCH["apply_rope"],
        "apply_rope_": nvidia.torch_cuda.apply_rope_,
    }
    monkeypatch.setattr(reg, "_cuda_available", lambda: True)
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    reg.reset_tables()
    try:
        assert set(reg.get_ops().traced) == {"rms_norm", "apply_rope", "apply_rope_"}
        monkeypatch.setenv("DEEPINFER_COMPILE_TRACED_OPS", "hc_write")
        assert set(reg.get_ops().traced) == {"rms_norm", "apply_rope", "apply_rope_"}  # built once ...
        reg.reset_tables()
        assert set(reg.get_ops().traced) == {"hc_write"}  # ... until rebuilt
    finally:
        reg.reset_tables()


def test_deep_gemm_switch_chooses_the_fp8_linear_when_the_table_is_built(monkeypatch):
    """DEEPINFER_DEEP_GEMM is read at the build: with `deep_gemm` importable (its probe answers yes here; the
    kernels are never launched) 1 takes DeepGEMM's FP8 GEMM, 0 the dequantised BF16 one."""
    from deepinfer_model.backends import nvidia

    monkeypatch.setattr(nvidia, "_has", lambda module: module == "deep_gemm")
    monkeypatch.setenv("DEEPINFER_DEEP_GEMM", "1")
    impls, _ = nvidia.select_kernels()
    assert impls["fp8_block_linear"] is nvidia.gemm.fp8_block_linear_deep_gemm
    assert impls["grouped_expert_mlp"] is nvidia.moe.grouped_expert_mlp_deep_gemm
    monkeypatch.setenv("DEEPINFER_DEEP_GEMM", "0")
    impls, _ = nvidia.select_kernels()
    assert impls["fp8_block_linear"] is nvidia.gemm.fp8_block_linear_dequant
    assert impls["grouped_expert_mlp"] is nvidia.moe.grouped_expert_mlp_dequant
