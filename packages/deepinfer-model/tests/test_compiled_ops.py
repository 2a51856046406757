"""The decode step's accelerator ops as `torch.library` custom ops inside a compiled region (`ops/compiled_ops.py`).

Each op is wrapped around its CPU reference here (the NVIDIA kernels need a GPU; their compiled step is
measured by `benchmarks/gpu/profile_decode_step.py`): compiled with `fullgraph=True` (a graph break is an
error) it must give the eager result bit for bit, and each fake must have the reference output's shapes
and dtypes, since inductor plans its buffers from them.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_model.compile_boundary import as_custom_op, custom_op_overloads, outside_compiled_graph
from deepinfer_model.ops import compiled_ops, get_ops
from deepinfer_model.ops import registry as reg
from deepinfer_model.runtime.compiled import register_inductor_fallbacks


def _inputs() -> dict[str, tuple[tuple, dict]]:
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    t, m, h = 3, 4, 32
    trunk = r(t, m, h, dtype=torch.bfloat16)
    e, inter, k = 4, 16, 2
    return {
        "rms_norm": ((r(t, 64, dtype=torch.bfloat16), r(64), 1e-6), {"out_dtype": torch.float32}),
        "apply_rope": ((r(t, 2, 64), r(t, 16), r(t, 16), True), {"out_dtype": torch.bfloat16}),
        "apply_rope_": ((r(t, 2, 64, dtype=torch.bfloat16), r(t, 16), r(t, 16), True), {}),
        "hc_mixes": ((trunk, r((2 + m) * m, m * h) * 0.1, r((2 + m) * m), torch.rand(3, generator=g), 1e-6, 1e-6, 3), {}),
        "hc_read": ((trunk, torch.rand(t, m, generator=g)), {"out_dtype": torch.bfloat16}),
        "hc_mixes_read": ((trunk, r((2 + m) * m, m * h) * 0.1, r((2 + m) * m), torch.rand(3, generator=g), 1e-6, 1e-6, 3,
                           torch.rand(t, m, generator=g), torch.bfloat16), {}),
        "hc_write": ((r(t, h), trunk.float(), torch.rand(t, m, generator=g), torch.rand(t, m, m, generator=g)), {}),
        "index_scores": ((r(2, t, 4, 16, dtype=torch.bfloat16), r(2, 5, 16, dtype=torch.bfloat16), r(2, t, 4)),
                         {"limit": torch.tensor([[0, 2, 5], [1, 7, 3]]), "out_dtype": torch.bfloat16}),
        "expert_swiglu": (
            (r(t, h, dtype=torch.bfloat16), torch.randint(0, e, (t * k,), generator=g), torch.rand(t * k, generator=g),
             r(e, inter, h, dtype=torch.bfloat16), r(e, inter, h, dtype=torch.bfloat16), r(e, h, inter, dtype=torch.bfloat16),
             7.0, True),
            {},
        ),
        "expert_swiglu_sum": (
            (r(t, h, dtype=torch.bfloat16), torch.randint(0, e, (t * k,), generator=g), torch.rand(t * k, generator=g),
             r(e, inter, h, dtype=torch.bfloat16), r(e, inter, h, dtype=torch.bfloat16), r(e, h, inter, dtype=torch.bfloat16),
             7.0, True, r(t, h), torch.bfloat16, torch.float32),
            {},
        ),
        "swiglu": ((r(t, inter, dtype=torch.bfloat16), r(t, inter, dtype=torch.bfloat16), 1.5), {}),
        "block_max": ((r(t, 37, dtype=torch.bfloat16), torch.rand(t, 37, generator=g) < 0.7, 16), {}),
        "engram_gate": (
            (trunk, r(t, m, h, dtype=torch.bfloat16), r(t, h, dtype=torch.bfloat16), r(m, h),
             torch.tensor([False, True, False]), 1e-6, torch.bfloat16, torch.bfloat16),
            {},
        ),
    }  # fmt: skip


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _written(name: str) -> list[int]:
    """Positions of the arguments op `name` writes (`Tensor(a!)`): its results are those arguments."""
    from deepinfer_model.compile_boundary import _written_args

    args = torch._C.parse_schema(f"deepinfer::x{compiled_ops.SCHEMAS[name]}").arguments
    return [i for i, a in enumerate(args) if a.name in _written_args(compiled_ops.SCHEMAS[name])]


def _results(written: list[int], out, args) -> tuple:
    """An op's outputs, or for an op that writes into arguments (`written`, and returns nothing) those."""
    if written:
        assert out is None
        return tuple(args[i] for i in written)
    return _as_tuple(out)


def test_every_listed_op_has_inputs_here_and_a_contract():
    assert set(compiled_ops.SCHEMAS) == set(compiled_ops.FAKES) == set(_inputs())
    assert set(compiled_ops.SCHEMAS) <= set(reg.OP_SPECS)


@pytest.mark.parametrize("name", sorted(compiled_ops.SCHEMAS))
def test_fake_has_the_reference_shapes_and_dtypes(name):
    args, kwargs = _inputs()[name]
    if _written(name):  # writes into its arguments: returns nothing, as its fake does
        assert get_ops("cpu")[name](*args, **kwargs) is None
        assert compiled_ops.FAKES[name](*args, **kwargs) is None
        return
    ref = _as_tuple(get_ops("cpu")[name](*args, **kwargs))
    fake = _as_tuple(compiled_ops.FAKES[name](*args, **kwargs))
    assert [(o.shape, o.dtype) for o in fake] == [(o.shape, o.dtype) for o in ref]


@pytest.mark.parametrize("name", sorted(compiled_ops.SCHEMAS))
def test_custom_op_is_one_node_of_a_compiled_graph_with_the_eager_result(name):
    # (`region` is one code object for every op: without a reset its compiles per op count towards Dynamo's
    # recompile limit of 8, a hard failure under fullgraph=True once more ops are listed)
    torch._dynamo.reset()
    args, kwargs = _inputs()[name]
    kernel = get_ops("cpu")[name]
    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return kernel(*a, **kw)

    op = outside_compiled_graph(
        counted,
        as_custom_op(
            f"deepinfer::test_{name}", counted, compiled_ops.SCHEMAS[name], compiled_ops.FAKES[name]
        ),
    )
    written = _written(name)
    fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # (a writing op changes args)
    eager = _results(written, op(*args, **kwargs), args)

    def region(*a):
        out = _results(written, op(*a, **kwargs), a)
        return tuple(o * 1 for o in out)  # (an op of the graph after the call: reads what the op wrote)

    torch._dynamo.reset()  # (`region` is one code object for every op: past 8 of them, its recompile limit)
    compiled = torch.compile(region, backend="aot_eager", fullgraph=True)  # a graph break would raise
    got = compiled(*fresh)
    assert len(calls) >= 2  # the kernel ran inside the compiled region too, not a traced copy of it
    for a, b in zip(got, eager, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if written:  # the compiled region's write reached the caller's tensor
        for a, b in zip(_results(written, None, fresh), eager, strict=True):
            assert torch.equal(a, b)


def test_custom_op_outputs_never_alias_inputs():
    op = as_custom_op(
        "deepinfer::test_alias",
        lambda x: x.view(-1),
        "(Tensor x) -> Tensor",
        lambda x: x.new_empty(x.numel()),
    )
    x = torch.arange(6.0).reshape(2, 3)
    out = op(x)
    assert torch.equal(out, x.view(-1)) and out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_inductor_takes_each_custom_op_as_a_fallback_registered_before_it_compiles():
    """`runtime.compiled.register_inductor_fallbacks`: every custom op made so far is an inductor lowering
    before a compile meets it (left to inductor, torch 2.11 formatted each first call's argument IR as a
    tree, which doubled per layer of the decode step: its compile never ended), and an inductor-compiled
    region chaining a reading op through a writing one, with a shared input, gives the eager result."""
    from torch._inductor import lowering

    double = as_custom_op(
        "deepinfer::test_fallback_double",
        lambda x: x * 2,
        "(Tensor x) -> Tensor",
        lambda x: torch.empty_like(x),
    )

    def add_one_(x):
        x.add_(1)

    bump = as_custom_op("deepinfer::test_fallback_bump_", add_one_, "(Tensor(a!) x) -> ()", lambda x: None)
    ours = custom_op_overloads()
    for op in (
        torch.ops.deepinfer.test_fallback_double.default,
        torch.ops.deepinfer.test_fallback_bump_.default,
    ):
        assert op in ours and op not in lowering.lowerings
    register_inductor_fallbacks()
    assert all(op in lowering.lowerings for op in ours)

    def region(x):
        y = double(x)
        bump(y)
        return double(y + x) * 3  # (x reaches the last op by two paths)

    x = torch.randint(-50, 50, (2, 8)).float()  # (integers: the closed form below is exact)
    torch._dynamo.reset()
    got = torch.compile(region, backend="inductor", fullgraph=True)(x.clone())
    assert torch.equal(got, region(x.clone())) and torch.equal(got, (x * 3 + 1) * 6)


def test_nvidia_table_records_the_decode_ops_as_custom_ops():
    """Built on this host (the kernels are not launched): each listed NVIDIA op has a custom op behind it."""
    table = reg.OpTable("nvidia")
    for name in compiled_ops.SCHEMAS:
        if table.sources.get(name) == "nvidia" and name not in table.traced:
            assert hasattr(torch.ops.deepinfer, f"nvidia_{name}"), name


def test_bad_custom_op_switch_is_a_clear_error(monkeypatch):
    from deepinfer_model.compile_boundary import custom_ops_enabled

    monkeypatch.setenv("DEEPINFER_COMPILE_CUSTOM_OPS", "yes")
    with pytest.raises(ValueError, match="DEEPINFER_COMPILE_CUSTOM_OPS must be 0 or 1, got 'yes'"):
        custom_ops_enabled()
