"""NVIDIA (Hopper, SM90) backend: the ops whose libraries import on this machine, chosen when a table is built.

Importing this module reads no environment variable: `select_kernels` decides, each time the op registry
builds an NVIDIA table, which kernels serve the ops from the switches below (`deepinfer_cluster.envs`).

| op | implementation |
| --- | --- |
| rms_norm | TileLang kernel (`tilelang_norm.py`) |
| apply_rope | TileLang kernel (`tilelang_rope.py`) |
| apply_rope_ | TileLang kernel rotating only the last r channels in place (`tilelang_rope.py`; a rotation of every channel: `apply_rope`'s kernel, copied back), registered only where TileLang serves it; after a failure of it, or while `apply_rope` has fallen back to torch, `apply_rope` and a copy of the rotated tail (the same values). Unregistered, the model keeps the out-of-place op (`ops.model_calls.rope`) |
| hc_mixes | the projection (cuBLAS FP32 GEMM; a 16-bit prefill trunk: Triton TF32-split kernel) + Triton row norm and epilogue (`triton_mhc.py`) in native mode; in exact / batch-invariant mode, or without Triton, the TileLang epilogue (`tilelang_mhc.py`) |
| hc_mixes_read | a 16-bit prefill trunk in native mode: the Triton projection kernel also reading the sub-layer input (`triton_mhc.hc_mixes_read`, one pass over the trunk); else `hc_mixes` and `hc_read` as registered |
| hc_read, hc_write | TileLang kernels (`tilelang_mhc.py`) |
| fp8_block_linear | DeepGEMM `fp8_gemm_nt` if `deep_gemm` imports and `DEEPINFER_DEEP_GEMM` != 0, else dequantise + BF16 GEMM |
| grouped_expert_mlp | DeepGEMM `m_grouped_fp8_gemm_nt_contiguous` (same condition), else per-expert dequantised BF16 GEMMs (`moe.py`) |
| rows_matmul, pair_rows_matmul, tile_bmm | Triton row / tile kernels (`triton_rows.py`) if `triton` imports and `DEEPINFER_TRITON` != 0, else the reference tiles |
| expert_swiglu | Triton gate/up + SwiGLU and down kernels (`triton_moe.py`) for at most `triton_moe.MAX_PAIRS` 16-bit pairs (decode), else the reference's `torch._grouped_mm` calls |
| expert_swiglu_sum | the same per pair, summed per token with the shared expert: for more pairs (prefill) `torch._grouped_mm` with Triton SwiGLU and slot-sum kernels (`triton_moe_sum.py`); 16-bit operands, else the reference |
| swiglu | the Triton SwiGLU kernel of `triton_moe_sum.py` for contiguous 16-bit operands, else the reference |
| engram_gate | Triton kernel (`triton_engram.py`: one pass, one program per block of tokens, all streams) in native mode for 16-bit / FP32 operands and H <= `triton_engram.MAX_H`, else the reference |
| index_scores | Triton kernel (`triton_index.py`; power-of-two heads and head dim) if `triton` imports and `DEEPINFER_TRITON` != 0, else the reference |
| topk_indices | Triton radix select per row (`triton_select.py`) under the same condition, else the reference (torch top-k of the keys, then a sort) |
| block_max | Triton kernel (`triton_blocks.py`; power-of-two blocks, 16-bit / FP32 scores) under the same condition, else the reference |
| topk_keys | Triton kernel (`triton_keys.py`) if `triton` imports and `DEEPINFER_TRITON` != 0, else the reference's torch ops |
| sparse_prefill_attention | FlashMLA's legacy SM90 sparse prefill (`attention.py`; 64 / 128 heads of 512) if `flash_mla` imports and `DEEPINFER_FLASH_MLA` != 0, else the reference |
| sparse_decode_attention | torch FP32 gather + softmax with sink (FlashMLA's SM90 kernel rejects the V41 format) |
| kv_store_fp8 | not registered: the device-agnostic torch reference serves it |

`DEEPINFER_TILELANG`: `1` (default) the kernels checked on an H200 (`VERIFIED_TILELANG`), `all` also the
ones not yet checked there, `0` none. Without TileLang every such op uses its torch FP32 version in
`torch_cuda.py`. A TileLang kernel that fails to compile or launch (anything but a ValueError about
its inputs) is logged once at WARNING and replaced by its torch version for the rest of the process;
`TILELANG_FALLBACKS` records which and why. In batch-invariant mode the torch versions are replaced by
the `cpu` reference (their reductions are not row-invariant); the TileLang kernels are.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_cluster import envs

from ... import batch_invariant
from ...layers.rope import check_in_place
from ...ops.registry import register, register_selection
from . import gemm, moe, torch_cuda

logger = logging.getLogger("deepinfer_model.ops")

TILELANG_FALLBACKS: dict[str, str] = {}


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _kernel_or_torch(
    name: str,
    kernel: Callable,
    fallback: Callable,
    until_first_success: bool = False,
    supports: Callable[..., bool] | None = None,
) -> Callable:
    """`kernel`, replaced by `fallback` for good after its first failure other than a ValueError.

    `until_first_success`: only a failure before the kernel ever ran falls back (a compile error); later
    failures (an out-of-memory) are raised. For batch-invariant mode's GEMMs, whose bits must not change
    kernels in the middle of a run. `supports`: called with the op's arguments; the calls it rejects
    (operands or a mode the kernel does not take) go to `fallback` without trying the kernel."""
    current = [kernel]
    succeeded = [False]

    def call(*args, **kwargs):
        if supports is not None and not supports(*args, **kwargs):
            return fallback(*args, **kwargs)
        try:
            out = current[0](*args, **kwargs)
            succeeded[0] = True
            return out
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - a JIT/compile failure must not take the model down
            if current[0] is fallback or (until_first_success and succeeded[0]):
                raise
            logger.warning(
                "%s: kernel failed (%s: %s); using the torch version", name, type(exc).__name__, exc
            )
            TILELANG_FALLBACKS[name] = f"{type(exc).__name__}: {exc}"[:500]
            current[0] = fallback
            return fallback(*args, **kwargs)

    call.__name__ = f"{name}_tilelang_or_torch"
    return call


_TORCH = {
    "rms_norm": torch_cuda.rms_norm,
    "apply_rope": torch_cuda.apply_rope,
    "hc_mixes": torch_cuda.hc_mixes,
    "hc_read": torch_cuda.hc_read,
    "hc_write": torch_cuda.hc_write,
}

# Kernels checked against the CPU reference on an H200 (their `gpu` tests and the tiny V4.1 with every
# hot op on the GPU: logits rel. error 4.4e-7 in FP32, greedy tokens equal). apply_rope_ (the in-place tail
# rotation) is equal bit for bit to `apply_rope`'s kernel for every partial rotation in BF16 and FP32; a
# rotation of every channel in FP32 would differ in the last bit, so that case runs `apply_rope`'s kernel.
# DEEPINFER_TILELANG=all also enables kernels not yet checked on a GPU (none now); 0 turns TileLang off.
VERIFIED_TILELANG = ("rms_norm", "apply_rope", "hc_mixes", "hc_read", "hc_write", "apply_rope_")
# Ops an inductor-compiled decode step may trace in their torch versions (DEEPINFER_COMPILE_TRACED_OPS).
TRACEABLE = envs.TRACEABLE_OPS


def _reference_in_bi_mode(name: str, fn: Callable) -> Callable:
    """`fn` (a torch FP32 version), served by the `cpu` reference in batch-invariant mode: its torch
    reductions and cuBLAS GEMMs choose their split from the token count, the reference's go through the
    mode's fixed orders (the TileLang kernels are row-local: one CTA or thread per token)."""
    from .. import cpu as reference

    ref = getattr(reference, name)

    def call(*args, **kwargs):
        return (ref if batch_invariant.enabled() else fn)(*args, **kwargs)

    call.__name__ = f"{name}_torch_or_reference"
    return call


# The row-local ops of the table built last (kernels with their torch fallbacks): `apply_rope_`'s fallback
# rotates through the `apply_rope` registered with it.
_ROW_LOCAL: dict[str, Callable] = {}


def _rope_tail_via_copy(x, cos, sin, inverse=False) -> None:
    """`apply_rope_` as the registered `apply_rope` (whichever version serves it now) and a copy of its
    rotated tail into `x`: that op's values, with the whole row's traffic."""
    check_in_place(x, cos, sin)
    tail = x.shape[-1] - 2 * cos.shape[-1]
    x[..., tail:] = _ROW_LOCAL["apply_rope"](x, cos, sin, inverse, out_dtype=x.dtype)[..., tail:]


@dataclass(frozen=True)
class KernelSettings:
    """What the environment asks of the NVIDIA backend when a table is built (`deepinfer_cluster.envs`),
    with what this machine can import."""

    tilelang: str  # "0", "1" (the verified kernels) or "all"
    traced: tuple[str, ...]  # ops a compiled step traces in their torch versions
    deep_gemm: bool
    triton: bool
    triton_moe_max_pairs: int
    flash_mla: bool

    @classmethod
    def from_env(cls) -> KernelSettings:
        tilelang = envs.get("DEEPINFER_TILELANG")
        return cls(
            tilelang=tilelang if _has("tilelang") else "0",
            traced=envs.get("DEEPINFER_COMPILE_TRACED_OPS"),
            deep_gemm=envs.get("DEEPINFER_DEEP_GEMM") and _has("deep_gemm"),
            triton=envs.get("DEEPINFER_TRITON") and _has("triton"),
            triton_moe_max_pairs=envs.get("DEEPINFER_TRITON_MOE_MAX_PAIRS"),
            flash_mla=envs.get("DEEPINFER_FLASH_MLA") and _has("flash_mla"),
        )


# One selection per settings: rebuilding a table under the same environment keeps the same wrappers, and
# with them the kernels that have fallen back (`TILELANG_FALLBACKS`).
_SELECTIONS: dict[KernelSettings, tuple[dict[str, Callable], dict[str, Callable], dict[str, Callable]]] = {}


@register_selection("nvidia")
def select_kernels() -> tuple[dict[str, Callable], dict[str, Callable]]:
    """The environment-dependent ops of the NVIDIA table: (op -> implementation, op -> torch version a
    compiled region traces), decided now from `KernelSettings.from_env()`."""
    settings = KernelSettings.from_env()
    chosen = _SELECTIONS.get(settings)
    if chosen is None:
        chosen = _SELECTIONS[settings] = _select(settings)
    impls, traced, row_local = chosen
    _ROW_LOCAL.clear()
    _ROW_LOCAL.update(row_local)
    return impls, traced


def _select(s: KernelSettings) -> tuple[dict[str, Callable], dict[str, Callable], dict[str, Callable]]:
    impls: dict[str, Callable] = {}
    traced: dict[str, Callable] = {}
    kernels: dict[str, Callable] = {}
    if s.tilelang != "0":
        from . import tilelang_mhc, tilelang_norm, tilelang_rope

        hc_mixes = tilelang_mhc.hc_mixes
        if not s.triton:  # batch-invariant mode's mixes then take the reference (no row kernels)
            hc_mixes = functools.partial(tilelang_mhc.hc_mixes, triton_rows=False)
        kernels = {
            "rms_norm": tilelang_norm.rms_norm,
            "apply_rope": tilelang_rope.apply_rope,
            "hc_mixes": hc_mixes,
            "hc_read": tilelang_mhc.hc_read,
            "hc_write": tilelang_mhc.hc_write,
            "apply_rope_": tilelang_rope.apply_rope_,
        }
        if s.tilelang != "all":
            kernels = {k: v for k, v in kernels.items() if k in VERIFIED_TILELANG}
    else:
        logger.warning(
            "tilelang unavailable or DEEPINFER_TILELANG=0: norm, RoPE and mHC use torch FP32 versions"
        )

    row_local: dict[str, Callable] = {}
    for name, fn in _TORCH.items():
        fn = _reference_in_bi_mode(name, fn)
        row_local[name] = _kernel_or_torch(name, kernels[name], fn) if name in kernels else fn
        impls[name] = row_local[name]

    # The in-place RoPE (`ops.model_calls.rope(inplace=True)`) must give `apply_rope`'s bits: its TileLang kernel
    # writes the rotation as `apply_rope`'s kernel does (`tilelang_rope.py`), so it is registered only with that
    # kernel, and stands aside while `apply_rope` runs its torch version (a compile failure: TILELANG_FALLBACKS).
    # Without it the cpu reference would serve the op: the model then keeps the out-of-place op.
    if "apply_rope_" in kernels and "apply_rope" in kernels:
        rope_tail = _kernel_or_torch("apply_rope_", kernels["apply_rope_"], _rope_tail_via_copy)

        def apply_rope_(x, cos, sin, inverse=False) -> None:
            if "apply_rope" in TILELANG_FALLBACKS:
                return _rope_tail_via_copy(x, cos, sin, inverse)
            return rope_tail(x, cos, sin, inverse)

        impls["apply_rope_"] = apply_rope_

    # In a compiled (inductor) decode step the ops named by DEEPINFER_COMPILE_TRACED_OPS are traced in their
    # torch versions, not called: fused with the casts and elementwise ops around them (a graph break per call
    # left ~200 single-cast kernels in the medium V4.1's batch-1 step on the H200). None by default: on the
    # H200 tracing the norms and RoPE took that step from 933 to 846 kernels and 2.57 to 2.48 ms of kernel
    # time, but its graph replay was not faster within the run-to-run spread, and the compile took twice as
    # long; the mHC read / write became cuBLAS FP32 GEMV / GEMM calls, slower than the TileLang kernels. Eager
    # steps and batch-invariant mode (never compiled) call the kernels above. A traced apply_rope traces
    # apply_rope_ too (its torch version: the same ops on the tail, the same values). A traced hc_read covers
    # the final read only: V4.1's sub-layers read through `hc_mixes_read`, one custom-op node.
    for name in s.traced:
        traced[name] = _TORCH[name]
    if "apply_rope" in s.traced:
        traced["apply_rope_"] = torch_cuda.apply_rope_

    if s.deep_gemm:
        impls["fp8_block_linear"] = gemm.fp8_block_linear_deep_gemm
        impls["grouped_expert_mlp"] = moe.grouped_expert_mlp_deep_gemm
    else:
        logger.warning("deep_gemm unavailable or disabled: fp8_block_linear dequantises to a BF16 GEMM")
        impls["fp8_block_linear"] = gemm.fp8_block_linear_dequant
        impls["grouped_expert_mlp"] = moe.grouped_expert_mlp_dequant

    if s.triton:
        _select_triton(s, impls, row_local)
    else:
        logger.warning("triton unavailable or DEEPINFER_TRITON=0: batch-invariant GEMMs use the padded tiles")

    # Native-mode prefill attention (`models.grouped_attention.attend`): FlashMLA for the head shapes it takes. The core
    # asks `supports(heads, dim)` first and keeps its own band path for the others; the reference (a gather)
    # stands in only after a kernel failure.
    if s.flash_mla:
        from .. import cpu as reference
        from . import attention

        op = _kernel_or_torch(
            "sparse_prefill_attention", attention.sparse_prefill_attention, reference.sparse_prefill_attention
        )
        op.supports = attention.sparse_prefill_supports
        impls["sparse_prefill_attention"] = op
    else:
        logger.warning(
            "flash_mla unavailable or DEEPINFER_FLASH_MLA=0: prefill attention uses the torch band path"
        )
    return impls, traced, row_local


def _select_triton(s: KernelSettings, impls: dict[str, Callable], row_local: dict[str, Callable]) -> None:
    """The Triton kernels of the table (`DEEPINFER_TRITON` on and `triton` importable)."""
    from ... import numerics
    from .. import cpu as reference
    from . import (
        triton_blocks,
        triton_engram,
        triton_index,
        triton_keys,
        triton_mhc,
        triton_moe,
        triton_moe_sum,
        triton_rows,
        triton_select,
    )

    # Batch-invariant mode's GEMMs. A failure before a kernel first ran (a Triton compile error) falls back to
    # the reference tiles for the rest of the process; a later one is raised, so a run never changes kernels
    # (and bits) part-way.
    for name in ("rows_matmul", "pair_rows_matmul", "tile_bmm"):
        impls[name] = _kernel_or_torch(name, getattr(triton_rows, name), getattr(reference, name), True)

    # The mHC mixes in native mode: the projection, then one Triton program per token for the row norm and the
    # whole epilogue (`triton_mhc.py`; the TileLang epilogue runs a token's Sinkhorn iterations on one thread).
    # Exact and batch-invariant mode keep the row-local op: the kernels their CPU comparisons were set on
    # (with the Triton epilogue, whose norm sums in another order, one BF16 case of test_runtime_device moved
    # from within its 1e-2 to 1.5e-2 of the CPU; batch-invariant mode projects through the row kernels).
    row_local_mixes = row_local["hc_mixes"]
    fast_mixes = _kernel_or_torch("hc_mixes", triton_mhc.hc_mixes, row_local_mixes)

    def hc_mixes(*args, **kwargs):
        return (fast_mixes if numerics.native() else row_local_mixes)(*args, **kwargs)

    impls["hc_mixes"] = hc_mixes

    # ... and with the sub-layer's read (`ShiftedHC.sublayer`): a prefill's 16-bit trunk projected and read
    # in one pass (`triton_mhc.hc_mixes_read`); otherwise the two ops as selected here
    def composed_mixes_read(trunk, fn, base, scale, hc_eps, rms_eps, iters, read_weights, read_dtype):
        mixes = hc_mixes(trunk, fn, base, scale, hc_eps, rms_eps, iters)
        return (*mixes, row_local["hc_read"](trunk, read_weights, read_dtype))

    def fuses_read(trunk, fn, base, scale, hc_eps, rms_eps, iters, read_weights, read_dtype) -> bool:
        return (
            numerics.native() and not batch_invariant.enabled() and triton_mhc.fuses_read(trunk, read_dtype)
        )

    impls["hc_mixes_read"] = _kernel_or_torch(
        "hc_mixes_read", triton_mhc.hc_mixes_read, composed_mixes_read, supports=fuses_read
    )

    # Native mode's routed experts (`layers.experts.grouped_swiglu`): up to `triton_moe_max_pairs` (token,
    # slot) pairs, as in a decode step, two Triton kernels over the expert-sorted pairs (`triton_moe.py`); more
    # pairs (prefill), or operands the kernels do not take, the reference's grouped GEMMs (CUTLASS via torch).
    max_pairs = s.triton_moe_max_pairs

    def few_pairs(x, pairs, weights, w1, *_rest) -> bool:
        return pairs.numel() <= max_pairs and triton_moe.supports(x, w1)

    impls["expert_swiglu"] = _kernel_or_torch(
        "expert_swiglu", triton_moe.expert_swiglu, reference.expert_swiglu, supports=few_pairs
    )

    # ... and summed per token (`layers.experts.experts_forward_static`'s grouped method): the grouped GEMMs
    # with the SwiGLU and the slot sum as Triton kernels (`triton_moe_sum.py`), the few-pairs kernels above
    # for decode steps
    impls["expert_swiglu_sum"] = _kernel_or_torch(
        "expert_swiglu_sum",
        functools.partial(triton_moe_sum.expert_swiglu_sum, max_pairs=max_pairs),
        reference.expert_swiglu_sum,
        supports=lambda x, pairs, weights, w1, *_rest: triton_moe_sum.grouped_supports(x, w1),
    )

    # ... and the shared expert's activation (`layers.experts.mlp` in native mode): the same SwiGLU kernel
    impls["swiglu"] = _kernel_or_torch(
        "swiglu", triton_moe_sum.swiglu_op, reference.swiglu, supports=triton_moe_sum.swiglu_supports
    )

    # Engram injection's gate and update in native mode (`models.deepseek_v41.engram.engram_inject`): one
    # Triton pass over the trunk, keys and values (`triton_engram.py`) instead of ~10 torch passes over FP32
    # copies of the trunk. Exact mode (FP64 carrier), batch-invariant mode (needs exact) and operands the
    # kernel does not take keep the reference.
    def gate_fused(trunk, k, v, qk, image, eps, act_dtype, out_dtype) -> bool:
        return numerics.native() and triton_engram.supports(trunk, k, v, act_dtype, out_dtype)

    impls["engram_gate"] = _kernel_or_torch(
        "engram_gate", triton_engram.engram_gate, reference.engram_gate, supports=gate_fused
    )

    # The indexer's scores in native mode (`models.grouped_attention.grouped_index_scores`): the core asks
    # `supports(heads, dim)` first and keeps its own path for other shapes.
    op = _kernel_or_torch("index_scores", triton_index.index_scores, reference.index_scores)
    op.supports = triton_index.supports
    impls["index_scores"] = op

    # The indexer's top-k keys (`layers.indexer._select_topk_keys`): one kernel instead of three torch passes
    impls["topk_keys"] = _kernel_or_torch("topk_keys", triton_keys.topk_keys, reference.topk_keys)
    # ... and the whole selection, ascending (`layers.indexer._select_topk`): a radix select per row
    impls["topk_indices"] = _kernel_or_torch(
        "topk_indices", triton_select.topk_indices, reference.topk_indices
    )
    # ... and the candidate blocks' scores (`models.deepseek_v41.sparse.candidate_blocks`): one pass
    impls["block_max"] = _kernel_or_torch(
        "block_max", triton_blocks.block_max, reference.block_max, supports=triton_blocks.supports
    )


# FlashMLA's SM90 (legacy) sparse decode supports the V3.2 and V4 cache formats but not V41's 528-byte
# one (on an H200: "required but not supported: V41_KVCACHE_FORMAT"), so
# `attention.py` is kept for a V4-format cache and the torch path serves the op for now.
register("nvidia", "sparse_decode_attention")(torch_cuda.sparse_decode_attention)
