"""Rounding points and the compute carrier of the model (`DEEPINFER_NUMERICS=exact|native`).

`exact` (the default, the CPU reference): blocks compute in FP64 and `round_to(x, act_dtype)` marks
every place where the engine stores a value: FP32 (the oracle setting) or BF16 (real checkpoints).
Accumulating in FP64 and rounding to at most FP32 makes each row's result independent of how many rows
are computed together (CPU GEMM blocking changes FP32 sums with the batch shape), so a prefix forward, a
decode step and a batched forward give bitwise equal rows - the property the paged runtime is tested
against.

`native` (for accelerators, where FP64 math runs at a fraction of the BF16 rate and FP64 weight copies
double the bytes read per step): the same rounding points, but the carrier between them is FP32, and
`linear` multiplies `act_dtype` operands (a BF16 GEMM with FP32 accumulation when `act_dtype` is BF16;
weights are held dequantised, so BF16 copies of them are cached); the attention score and P.V products
and the indexer's q.k take `attention_operands(act_dtype)` operands through `bmm_f32` (BF16 with FP32
accumulation for BF16 activations, P rounded to BF16). Results are then close to `exact`,
not bitwise equal, and rows may depend on the batch shape; batch-invariant mode therefore requires
`exact`.

Every block gets its carrier from `carrier()` / `carry(x)`. Within a model step (`resolved()`, which the
paged runner enters once per step and once per draft forward: the environment lookups cost ~5% of a
tiny-model step when made at every call) both settings, and the accelerator the op registry serves, are
the values read at the step's start; outside one they are read from the environment at every call, so
tests and benchmarks may switch them between steps.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from deepinfer_cluster import envs

from . import batch_invariant
from .batch_invariant import switch as batch_invariant_switch
from .compile_boundary import outside_compiled_graph
from .ops import registry as ops_registry
from .step_pin import StepPin

ENV = "DEEPINFER_NUMERICS"
MODES = ("exact", "native")


# `.value`: (mode, carrier) for the model step this thread runs (`resolved`), None outside one.
_PINNED = StepPin()


@contextlib.contextmanager
def resolved():
    """Read `DEEPINFER_NUMERICS`, `DEEPINFER_BATCH_INVARIANT` and `DEEPINFER_ACCELERATOR` once (validated)
    and serve those values to `mode()` / `carrier()` / `batch_invariant.enabled()` / `ops.get_ops()` until
    the block ends (nested blocks re-read them and restore the outer values)."""
    states = (_PINNED, batch_invariant_switch._PINNED, ops_registry._PINNED)
    outer = tuple(state.value for state in states)
    for state in states:  # read afresh, not the outer values
        state.value = None
    value = mode()
    try:
        batch_invariant_switch._PINNED.value = batch_invariant_switch.read_env()
        ops_registry._PINNED.value = (ops_registry.read_accelerator(),)
        _PINNED.value = (value, torch.float32 if value == "native" else torch.float64)
        yield
    finally:
        for state, kept in zip(states, outer):
            state.value = kept


def pinned(fn):
    """`fn` run within `resolved()` (the settings read once per call of `fn`: a model step)."""

    @functools.wraps(fn)
    def step(*args, **kwargs):
        with resolved():
            return fn(*args, **kwargs)

    return step


def mode() -> str:
    """'exact' (FP64 carrier, default) or 'native' (FP32 carrier, act-dtype GEMMs); ValueError otherwise."""
    pinned_mode = _PINNED.value
    if pinned_mode is not None:
        return pinned_mode[0]
    value = envs.get(ENV)
    if value == "native" and batch_invariant.enabled():
        raise ValueError(
            f"{ENV}=native cannot be combined with {batch_invariant.ENV}=1: batch-invariant mode needs "
            f"the FP64 carrier, set {ENV}=exact (or unset it) or unset {batch_invariant.ENV}"
        )
    return value


def native() -> bool:
    return mode() == "native"


def carrier() -> torch.dtype:
    """The dtype values travel in between rounding points: FP64 (exact) or FP32 (native)."""
    pinned_mode = _PINNED.value
    if pinned_mode is not None:
        return pinned_mode[1]
    return torch.float32 if native() else torch.float64


def carry(x: torch.Tensor) -> torch.Tensor:
    """`x` in the carrier dtype (no copy when it already is)."""
    return x.to(carrier())


# Converted copies of weights (FP64 for exact, act_dtype for native), made once instead of on every
# call (converting the weights dominated the CPU step time), and other tensors derived from a weight
# (`derived_weight`). Keyed by the weight's id and what was derived, guarded by a weak reference to it (ids
# are reused after a tensor dies) and by its in-place version counter, so an in-place update (e.g. an EPLB
# weight shuffle) is never served a stale copy. Tensors compare elementwise, so they cannot be dict keys.
_WEIGHTS: dict[tuple[int, object, bool], tuple[weakref.ref, int, torch.Tensor]] = {}


def derived_weight(weight: torch.Tensor, what: object, make) -> torch.Tensor:
    """`make(weight)`, made once per (tensor, `what`) and kept until the tensor is modified in place or dies
    (an inference tensor keeps no version: made at every call, as a cached copy could go stale unseen)."""
    version = batch_invariant.version_of(weight)
    if version is None:
        return make(weight)
    # A trained weight's copy made with gradients on carries its graph and one made without does not: each
    # is kept apart, or a no-grad forward (a frozen model's, training a drafter) would hand the next
    # training forward a copy through which no gradient reaches the weight.
    key = (id(weight), what, weight.requires_grad and torch.is_grad_enabled())
    cached = _WEIGHTS.get(key)
    if cached is not None and cached[0]() is weight and cached[1] == version:
        return cached[2]
    out = make(weight)
    if cached is None or cached[0]() is not weight:
        weakref.finalize(weight, _WEIGHTS.pop, key, None)
    _WEIGHTS[key] = (weakref.ref(weight), version, out)
    return out


def _cached_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return derived_weight(weight, dtype, lambda w: _converted(w, dtype))


def _converted(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    copy = weight.to(dtype)
    if dtype in _COPY_ATTRS and batch_invariant.version_of(weight) is not None:
        setattr(weight, _COPY_ATTRS[dtype], copy)
    return copy


# The latest cached copy per dtype is also an attribute of the weight, which a compiled region reads as one more
# graph input (a lookup in `_WEIGHTS` by id is host code: a graph break at every linear, ~100 in the medium
# V4.1's decode step). The copy exists from the first eager use (the prefill before any decode step); a graph
# captured from it keeps reading that copy, as the plain step's CUDA graphs do.
_COPY_ATTRS = {torch.bfloat16: "_deepinfer_bfloat16", torch.float16: "_deepinfer_float16"}


def weight_as(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` converted to `dtype`, cached per tensor until the tensor is modified in place.

    In native mode a view (one expert of a stacked [E, N, K] tensor, taken anew at every call) is
    served as the same view of its base's cached copy, so the stack is converted once; views share
    their base's version counter, so in-place updates still invalidate it. (Exact mode keeps converting
    such views per call: caching FP64 copies of every expert would triple the experts' memory.)
    """
    if weight.dtype == dtype:
        return weight
    if dtype in _COPY_ATTRS and torch.compiler.is_compiling():
        copy = getattr(weight, _COPY_ATTRS[dtype], None)
        if copy is not None:
            return copy
    return _converted_weight(weight, dtype)


@outside_compiled_graph  # a compiled step takes the cached copy instead of converting every weight
def _converted_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    base = weight._base
    if base is not None and dtype != torch.float64 and base.is_contiguous():
        full = _cached_copy(base, dtype)  # contiguous, so it has the base's strides
        offset = weight.storage_offset() - base.storage_offset()
        return full.as_strided(weight.shape, weight.stride(), full.storage_offset() + offset)
    return _cached_copy(weight, dtype)


def weight_fp64(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as FP64, cached per tensor until the tensor is modified in place."""
    return weight_as(weight, torch.float64)


def weight_carrier(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in the carrier dtype (cached; an FP32 weight in native mode is used as it is)."""
    return weight_as(weight, carrier())


def round_to(x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded (round-to-nearest-even) to `act_dtype` (FP32 or BF16), returned in the carrier dtype.
    In batch-invariant mode the result is marked FP32-valued (`batch_invariant.mark_fp32_valued`): its
    GEMMs then skip the per-call test of every value (`batch_invariant.row_gemm`)."""
    out = x.to(act_dtype).to(carrier())
    if batch_invariant.enabled() and act_dtype in (torch.float32, torch.bfloat16, torch.float16):
        batch_invariant.mark_fp32_valued(out)
    return out


def narrow_act(act_dtype: torch.dtype) -> bool:
    """Whether values rounded to `act_dtype` may travel in `act_dtype` itself rather than widened to the
    carrier: native mode with a 16-bit act dtype. Only where every consumer takes such a tensor (act-dtype
    GEMM / attention operands, kernels that read 16-bit inputs) or widens it itself before computing in its
    dtype: the values are the same, the widened copy and the narrowing again before the next product are
    saved (a 16k-token medium prefill spent ~110 of its 370 ms on the H200 in such conversions). V4.1 holds
    so the mHC trunk, the read and norm output that are each sub-layer's input (`ShiftedHC`), the query,
    the attention output and its projections, and the index scores. Never in exact mode, so never in
    batch-invariant mode (which requires exact: `mode()`), whose FP32-valued marks stay on carrier tensors."""
    return act_dtype in (torch.bfloat16, torch.float16) and native()


def round_narrow(x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """`round_to(x, act_dtype)`, as an `act_dtype` tensor where `narrow_act(act_dtype)`."""
    return x.to(act_dtype) if narrow_act(act_dtype) else round_to(x, act_dtype)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` of act-dtype operands, accumulated and returned in FP32 (a 1-D `a` is one row)."""
    if a.dim() == 1:
        return _mm_f32(a.unsqueeze(0), b)[0]
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:  # cuBLAS BF16 GEMM with an FP32 output (no rounding of the products' sums to BF16)
        if _tracks_grad(a, b):
            return _ProductF32.apply(a, b)
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # BF16 values are exact in FP32


def attention_operands(act_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention / indexer score and P.V products multiply: the carrier (FP64) in exact mode;
    in native mode `act_dtype` when it is BF16 (tensor-core products, FP32 accumulation), else FP32."""
    if not native():
        return torch.float64
    return torch.bfloat16 if act_dtype == torch.bfloat16 else torch.float32


def bmm_operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded to the product operand dtype `dtype`, in the form `bmm_f32` takes it: BF16 on CUDA;
    on other devices FP32 holding the rounded values (no CPU kernel takes BF16 operands to an FP32
    output, and BF16 values are exact in FP32). Convert once and reuse where an operand is reused."""
    if dtype == torch.float32 or x.is_cuda:
        return x.to(dtype)
    return x.to(dtype).float()


def bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched `a @ b` ([B, m, k] @ [B, k, n]) of `bmm_operand` tensors, accumulated and returned in FP32.

    CUDA BF16: `torch.bmm(..., out_dtype=torch.float32)` (tensor cores, FP32 accumulator, no rounding of
    the sums to BF16; a plain BF16 bmm would round every score and output element to BF16). Otherwise
    an FP32 bmm, whose products of BF16 values are exact (8 + 8 significant bits fit in FP32's 24).
    """
    if a.dtype == torch.bfloat16:
        if _tracks_grad(a, b):
            return _ProductF32.apply(a, b)
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a, b)


def _tracks_grad(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)


class _ProductF32(torch.autograd.Function):
    """`mm` / `bmm` of 16-bit operands with an FP32 output, differentiable (training through the model: the
    `out_dtype` GEMMs have no derivative). The backward products take 16-bit operands too, the incoming
    FP32 gradient rounded to the operands' dtype, as a BF16 mixed-precision step's backward does."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        g = grad.to(a.dtype)
        ga = g @ b.transpose(-1, -2) if ctx.needs_input_grad[0] else None
        gb = a.transpose(-1, -2) @ g if ctx.needs_input_grad[1] else None
        return ga, gb


# act dtypes the mode's device row kernels round to as they store (`rows_matmul(..., round_to=)`, bit for
# bit `round_to`): a projection is then one kernel instead of three (the eager step is launch-bound)
KERNEL_ROUNDINGS = (torch.float32, torch.bfloat16, torch.float16)


def _row_invariant(
    x: torch.Tensor, weight: torch.Tensor, act_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Batch-invariant mode: FP64 `x @ weight.T` whose rows do not depend on the batch, `round_to(...,
    act_dtype)` when `act_dtype` is given. On the CPU `batch_invariant.row_gemm` against a row-major FP64
    copy made straight from `weight`; elsewhere the backend's `rows_matmul` op on the weight as stored
    (`batch_invariant.device_rows`, rounding in the kernel), which the graph-safe expert path's
    `pair_rows_matmul` matches row for row when handed the same stored weights."""
    flat = x.double()
    if flat.dim() != 2:
        flat = flat.reshape(-1, x.shape[-1])
    fused = act_dtype in KERNEL_ROUNDINGS and x.device.type != "cpu"
    if x.device.type == "cpu":
        narrow = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        out = batch_invariant.row_gemm(flat, weight.t(), narrow or batch_invariant.marked_fp32_valued(x))
    else:
        out = batch_invariant.device_rows(flat, weight, act_dtype if fused else None)
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], weight.shape[0])
    if fused:
        return batch_invariant.mark_fp32_valued(out)  # (what `round_to` marks)
    return out if act_dtype is None else round_to(out, act_dtype)


def linear(
    x: torch.Tensor, weight: torch.Tensor, act_dtype: torch.dtype = torch.float32, narrow: bool = False
) -> torch.Tensor:
    """`x @ weight.T`, output rounded once to `act_dtype` (returned in the carrier dtype; with `narrow`, as
    an act-dtype tensor where `narrow_act(act_dtype)`).

    exact: accumulated in FP64. native: a GEMM of `act_dtype` operands with FP32 accumulation, whose
    output the GEMM itself rounds to `act_dtype` (`x` already holds `act_dtype` values at every call).
    """
    if native():
        out = x.to(act_dtype) @ weight_as(weight, act_dtype).t()
        return out if narrow and narrow_act(act_dtype) else out.to(torch.float32)
    if batch_invariant.enabled():
        return _row_invariant(x, weight, act_dtype)
    return round_to(x.double() @ weight_fp64(weight).t(), act_dtype)


def logits(x: torch.Tensor, weight: torch.Tensor, act_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP32 `x @ weight.T` (LM / Markov heads: logits are FP32, never rounded to `act_dtype`).

    exact: FP64 accumulation; native: `act_dtype` operands with an FP32 accumulator and output.
    """
    if native():
        return _mm_f32(x.to(act_dtype), weight_as(weight, act_dtype).t())
    if batch_invariant.enabled():
        return _row_invariant(x, weight).float()
    return (x.double() @ weight_fp64(weight).t()).float()
