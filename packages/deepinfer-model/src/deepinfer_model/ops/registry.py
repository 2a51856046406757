"""The op registry: op name -> implementation of the selected backend.

Backends register functions under the names of `OP_SPECS` (the contract every implementation
follows). `get_ops()` returns an `OpTable` for the backend chosen by `resolve_backend()`; an op the
backend does not implement is served by the `cpu` reference (logged once), so a partial backend
is usable while it grows. `OpTable.sources` says which backend serves each op.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

from deepinfer_cluster import envs

from ..compile_boundary import as_custom_op, custom_ops_enabled, outside_compiled_graph
from ..step_pin import StepPin
from . import compiled_ops

logger = logging.getLogger("deepinfer_model.ops")

BACKENDS = ("cpu", "nvidia")
RESERVED_BACKENDS = ("ascend",)

# name -> contract. Tensors are on the backend's device; activations are FP32 or BF16, or FP64 holding
# values already rounded to the activation dtype (the reference model's carrier; then `out_dtype`
# names the activation dtype). Every op rounds its output once, as the CPU reference does.
OP_SPECS: dict[str, str] = {
    "rms_norm": "rms_norm(x [..., H], weight [H] | None, eps, out_dtype=None) -> out_dtype or x.dtype; "
    "FP32 statistics, one rounding",
    "apply_rope": "apply_rope(x [T, ..., C], cos [T, r/2], sin [T, r/2], inverse=False, out_dtype=None) "
    "-> out_dtype or x.dtype; interleaved pairs of the last r channels",
    "apply_rope_": "apply_rope_(x [T, ..., C] contiguous FP32 | BF16, cos [T, r/2], sin [T, r/2], inverse=False) "
    "-> None; x's last r channels replaced by apply_rope(x, cos, sin, inverse)'s (out_dtype = x.dtype) bit for "
    "bit, only they read and written (ValueError for another x: `layers.rope.in_place_problem`)",
    "hc_mixes": "hc_mixes(trunk [T, m, H], fn [(2+m)m, mH], base, scale [3], hc_eps, rms_eps, iters) "
    "-> (pre [T, m], post [T, m], comb [T, m, m]) FP32; in batch-invariant mode each token's result depends "
    "on that token only",
    "hc_mixes_read": "hc_mixes_read(trunk [T, m, H], fn, base, scale, hc_eps, rms_eps, iters, read_weights [T, m], "
    "read_dtype) -> (pre, post, comb) = hc_mixes(trunk, fn, base, scale, hc_eps, rms_eps, iters) and read [T, H] "
    "= hc_read(trunk, read_weights, read_dtype): a sub-layer's mixes and its input under the previous pre mix, "
    "from one pass over the trunk where the backend can",
    "hc_read": "hc_read(trunk [T, m, H], weights [T, m], out_dtype=None) -> [T, H] out_dtype or trunk.dtype",
    "hc_write": "hc_write(y [T, H], trunk [T, m, H], post [T, m], comb [T, m, m], out_dtype=None) "
    "-> [T, m, H] out_dtype or trunk.dtype",
    "rows_matmul": "rows_matmul(x [M, K] float64 | float32, weight [N, K] any float dtype, round_to=None) -> "
    "[M, N] x.dtype = x @ weight.T accumulated in x.dtype, each row's bits a function of that row and the "
    "weight only (never of M or the row index); round_to (float32 | bfloat16 | float16): the output rounded to "
    "it, bit for bit .to(round_to).to(x.dtype): batch-invariant mode's projections off the CPU",
    "pair_rows_matmul": "pair_rows_matmul(x [P, K] float64 | float32, weights [E, N, K], pairs [P] long, "
    "round_to=None) -> [P, N] x.dtype; row p = rows_matmul(x[p:p+1], weights[pairs[p]], round_to) bit for bit "
    "(the graph-safe expert path)",
    "tile_bmm": "tile_bmm(a [Na, m, k] float64, b [Nb, k, n] float64, ia [N] long | None, ib [N] long | None) -> "
    "[N, m, n] = a[ia[j]] @ b[ib[j]] (None: j itself, Na = Nb = N); each product's bits a function of its two "
    "matrices only (never of N or of the other products): batch-invariant mode's attention tiles off the CPU",
    "fp8_block_linear": "fp8_block_linear(x [T, K] bf16, w [N, K] e4m3, w_scale [ceil(N/128), ceil(K/128)]) "
    "-> [T, N] bf16; x quantised per token in 1x128 groups (power-of-two scales), FP32 accumulation",
    "grouped_expert_mlp": "grouped_expert_mlp(x [T, H] bf16, topk_weights [T, k] fp32, topk_ids [T, k] int, "
    "w13 [E, 2I, H] e4m3 (gate rows then up rows), s13 [E, 2I/128, H/128] fp32, w2 [E, H, I] e4m3, "
    "s2 [E, H/128, I/128] fp32, limit, weight_before_down=True) -> [T, H] fp32; per pair [g|u] = "
    "bf16(W13_e Q8(x)), h = silu(min(g, L)) clamp(u, -L, L) (* w) in FP32, o = bf16(W2_e Q8(h)) (* w after "
    "w2 if not weight_before_down), summed over slots in slot order in FP32 (left unrounded so the caller "
    "adds the shared expert before the one bf16 rounding); Q8 = per-token 1x128 power-of-two FP8",
    "expert_swiglu": "expert_swiglu(x [T, H] 16-bit | FP32, pairs [T*k] int (pair p: token p // k, expert "
    "pairs[p]), weights [T*k] FP32, w1 [E, I, H], w3 [E, I, H], w2 [E, H, I] (x's dtype), limit, weight_before_down) "
    "-> [T*k, H] FP32 in pair order; per pair g, u = x.dtype(W1_e x), x.dtype(W3_e x) (FP32 accumulation), h = "
    "silu(min(g, L)) clamp(u, -L, L) (* w) in FP32 rounded to x.dtype, y = x.dtype(W2_e h) (* w after w2 if not "
    "weight_before_down): native mode's routed MLP, no host sync",
    "expert_swiglu_sum": "expert_swiglu_sum(x, pairs, weights, w1, w3, w2, limit, weight_before_down (as "
    "expert_swiglu), addend [T, H] | None, act_dtype, out_dtype) -> [T, H] out_dtype; the expert_swiglu rows of "
    "each token's k pairs summed in slot order in FP32 from +0, plus addend (the shared expert), rounded once "
    "to act_dtype: native mode's routed MoE, no host sync",
    "topk_indices": "topk_indices(scores [T, n] bf16 | fp16, valid [T, n] bool, k >= 1) -> int64 [T, k], n <= "
    "65536: per row the indices of the k largest topk_keys keys (the best valid scores, ties to the lower index, "
    "-0.0 == +0.0) that are valid, ascending, -1 padded (the indexer's top-k of 16-bit scores)",
    "block_max": "block_max(scores [T, n] float, valid [T, n] bool, block >= 1) -> (max [T, ceil(n / block)] "
    "scores.dtype: the max of each block of `block` consecutive entries over its valid ones, -inf where none is "
    "valid; count [T] int64: the valid entries of each row) (the candidate blocks' scores)",
    "swiglu": "swiglu(gate [..., N], up [..., N] (gate's dtype: 16-bit or FP32), limit, out_dtype=None) -> "
    "out_dtype or gate.dtype = silu(min(gate, L)) * clamp(up, -L, L) in FP32, rounded once: the shared "
    "expert's activation where its projections stay in the act dtype (native mode)",
    "engram_gate": "engram_gate(trunk [T, m, H], k [T, m, H], v [T, H], qk [m, H] FP32, image [T] bool, eps, "
    "act_dtype, out_dtype) -> [T, m, H] out_dtype; per token and stream, in the carrier (FP32 in native mode): "
    "x = trunk[t, i], d = sum(x k qk) rsqrt(mean(x^2) + eps) rsqrt(mean(k^2) + eps) / sqrt(H), g = "
    "sigmoid(sign(d) sqrt(max(|d|, 1e-6))), out = x + g v[t] rounded once to act_dtype; image rows: the trunk's "
    "values (Engram injection after its kv projection; k, v may be strided views of that projection's rows)",
    "topk_keys": "topk_keys(scores [T, n] bf16 | fp16, valid [T, n] bool) -> int32 [T, n], n <= 65536: key = "
    "k16 * 65536 + (65535 - j), k16 the score's sign-magnitude bits as two's complement (-0.0 and +0.0 both 0), "
    "-32768 where not valid: unique per row, ordered like (score desc, index asc) (the indexer's top-k)",
    "kv_store_fp8": "kv_store_fp8(latent [T, 512], kv_cache uint8 [blocks, page, 1, 528], slots [T]) -> None; "
    "V4.1 FP8 cache format (spec v41-model 4.9), slot = block * page + offset",
    "index_scores": "index_scores(q [G, T, h, d] bf16, keys [G, n, d] bf16, weights [G, T, h] FP32, limit int32 | "
    "int64 [G, T] | None = None, out_dtype FP32 | BF16 | FP16 | None (FP32) = None) -> [G, T, n] out_dtype "
    "= sum over h of weights * relu(q . k): BF16 products accumulated in FP32, FP32 weighting and head sum, "
    "rounded to nearest even to out_dtype (the indexer's scores in native mode); entries j >= limit[g, t] (not "
    "visible to that row) are 0, whatever the inputs",
    "sparse_prefill_attention": "sparse_prefill_attention(q [T, h, D] bf16, kv [S, D] bf16, indices [T, k] int32 "
    "(-1 = none), sinks [h] FP32, scale) -> [T, h, D] bf16; each query row over its listed keys (values = keys): "
    "BF16 products accumulated in FP32, FP32 softmax with the head's sink logit in the denominator, P rounded to "
    "BF16 for P.V (native-mode prefill attention over the window and the selected entries)",
    "sparse_decode_attention": "sparse_decode_attention(q [B, h, 512] bf16, kv_cache uint8 [blocks, page, 1, 528], "
    "indices [B, k] int32 (-1 = none), sinks [h] FP32, scale) -> [B, h, 512] bf16",
}

_IMPLS: dict[str, dict[str, Callable]] = {b: {} for b in BACKENDS}
# torch versions of accelerator ops that a compiled step traces instead of calling the op (`register(traced=True)`)
_TRACED: dict[str, dict[str, Callable]] = {b: {} for b in BACKENDS}
_TABLES: dict[str, OpTable] = {}
# backend -> fn() -> (op -> implementation, op -> traced torch version): the ops whose implementation the
# environment chooses (kernel switches), decided each time a table of the backend is built
_SELECTIONS: dict[str, Callable[[], tuple[dict[str, Callable], dict[str, Callable]]]] = {}


def register(backend: str, name: str, traced: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: `fn` implements op `name` on `backend`.

    `traced=True`: `fn` (plain torch, the op's contract) is instead what a `torch.compile`d region runs for
    the op, in place of one opaque call of the registered kernel. For small ops between GEMMs (norms, RoPE,
    stream mixing) in the compiled decode step: each opaque call splits the compiled graph, and the casts and
    elementwise ops at every split run as kernels of their own; traced, inductor fuses the op with them."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if name not in OP_SPECS:
        raise ValueError(f"unknown op {name!r}; ops are {sorted(OP_SPECS)}")

    def deco(fn: Callable) -> Callable:
        (_TRACED if traced else _IMPLS)[backend][name] = fn
        _TABLES.pop(backend, None)
        return fn

    return deco


def register_selection(backend: str) -> Callable[[Callable], Callable]:
    """Decorator: `fn()` chooses, from the environment as it is when a table of `backend` is built, the
    implementations of the ops that depend on it: returns (op -> implementation, op -> torch version a
    compiled region traces instead), which take precedence over `register`ed ones. So importing a backend
    has no effect that depends on the environment, and `reset_tables()` + `get_ops()` applies a change."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def deco(fn: Callable) -> Callable:
        _SELECTIONS[backend] = fn
        _TABLES.pop(backend, None)
        return fn

    return deco


def reset_tables() -> None:
    """Forget the built tables: the next `get_ops()` builds them again under the environment of then."""
    _TABLES.clear()
    _RESOLVED.clear()


def _build_accelerator() -> str | None:
    """What the build was configured for (`deepinfer_sched.build_info()`), None where unknown."""
    try:
        import deepinfer_sched

        return str(deepinfer_sched.build_info().get("accelerator"))
    except Exception:  # noqa: BLE001 - the native core is optional for the model package
        return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_backend(requested: str | None = None) -> str:
    """The backend ops run on.

    `requested` (or `$DEEPINFER_ACCELERATOR`) asks explicitly: `nvidia` without CUDA is an error.
    Otherwise the build's accelerator decides; a build for `nvidia` on a machine without CUDA falls
    back to `cpu` with a warning (the same install is usable for CPU tests).
    """
    return _resolve(requested if requested is not None else read_accelerator())


def _resolve(explicit: str | None) -> str:
    """`resolve_backend` with the explicit request (argument or environment) already read."""
    name = (explicit or _build_accelerator() or "cpu").strip().lower()
    if name in RESERVED_BACKENDS:
        raise ValueError(
            f"DEEPINFER_ACCELERATOR={name!r} is reserved and not implemented; use one of {BACKENDS}"
        )
    if name not in BACKENDS:
        raise ValueError(f"DEEPINFER_ACCELERATOR must be one of {BACKENDS}, got {name!r}")
    if name == "nvidia" and not _cuda_available():
        if explicit:
            raise RuntimeError("DEEPINFER_ACCELERATOR=nvidia but torch sees no CUDA device")
        logger.warning("build targets nvidia but no CUDA device is visible: using the cpu reference ops")
        return "cpu"
    return name


def _load(backend: str) -> None:
    importlib.import_module(f"deepinfer_model.backends.{backend}")


class OpTable:
    """The resolved ops of one backend: `table.rms_norm(...)`, `table["rms_norm"]`, `table.sources`.

    Each op is an instance attribute of its own, so `table.name` on the hot paths (ops are called per
    layer) is a plain lookup; replacing an op (tests) is `setattr(table, name, fn)`, which both forms see."""

    def __init__(self, backend: str):
        _load("cpu")
        if backend != "cpu":
            _load(backend)
        self.backend = backend
        self.sources: dict[str, str] = {}
        chosen, chosen_traced = _SELECTIONS[backend]() if backend in _SELECTIONS else ({}, {})
        impls = {**_IMPLS[backend], **chosen}
        # op -> the torch version a compiled region traces instead of calling the op
        self.traced: dict[str, Callable] = {**_TRACED[backend], **chosen_traced}
        fns: dict[str, Callable] = {}
        for name in OP_SPECS:
            if name in impls:
                # inside a compiled step (runtime/compiled.py) an accelerator kernel is its registered torch
                # version traced, a custom op (the decode step's ops), or else one opaque call
                kernel, traced = impls[name], self.traced.get(name)
                if traced is None and name in compiled_ops.SCHEMAS and custom_ops_enabled():
                    # recorded as a custom op (one node, no graph break: `compiled_ops`)
                    qualname = f"deepinfer::{backend}_{name}"
                    traced = as_custom_op(
                        qualname, kernel, compiled_ops.SCHEMAS[name], compiled_ops.FAKES[name]
                    )
                fns[name], self.sources[name] = outside_compiled_graph(kernel, traced), backend
            elif name in _IMPLS["cpu"]:
                fns[name], self.sources[name] = _IMPLS["cpu"][name], "cpu"
                if backend != "cpu":
                    logger.info("op %s has no %s implementation: served by the cpu reference", name, backend)
        clash = set(fns) & {"backend", "sources", "names", "traced"}
        if clash:
            raise RuntimeError(f"op names {sorted(clash)} clash with OpTable attributes")
        self.names = frozenset(fns)
        self.__dict__.update(fns)

    def __getitem__(self, name: str) -> Callable:
        if name not in self.names:
            raise KeyError(f"op {name!r} is not implemented; ops are {sorted(self.names)}")
        return self.__dict__[name]

    def __getattr__(self, name: str) -> Callable:  # (only reached when the name is not an attribute)
        raise AttributeError(f"op {name!r} is not implemented; ops are {sorted(OP_SPECS)}")

    def __repr__(self) -> str:
        return f"OpTable(backend={self.backend!r}, sources={self.sources})"


# get_ops() runs per op call on hot paths (~250 times per eager batch-invariant step on a GPU): the resolved
# backend is kept per (request, $DEEPINFER_ACCELERATOR) and the probes it used (tests replace them).
_RESOLVED: dict[tuple, str] = {}

# $DEEPINFER_ACCELERATOR as read at the start of the model step this thread runs (`numerics.resolved` sets
# `.value`, a 1-tuple since the value may be None), None outside one: within a step get_ops() reads nothing.
_PINNED = StepPin()


def read_accelerator() -> str | None:
    """`DEEPINFER_ACCELERATOR` as set now (unset: None)."""
    return envs.get("DEEPINFER_ACCELERATOR")


def get_ops(backend: str | None = None) -> OpTable:
    """The op table of `backend` (default: `resolve_backend()`), built once per backend (until
    `reset_tables()`); its kernels are chosen from the environment when it is built. An explicit
    backend does not depend on $DEEPINFER_ACCELERATOR; the default one reads it at every call outside a
    model step (tests switch it between calls) and takes the step's value within one."""
    accelerator = None
    if backend is None:
        pinned = _PINNED.value
        accelerator = read_accelerator() if pinned is None else pinned[0]
    key = (backend, accelerator, _cuda_available, _build_accelerator)
    name = _RESOLVED.get(key)
    if name is None:
        name = _RESOLVED[key] = _resolve(backend if backend is not None else accelerator)
    if name not in _TABLES:
        _TABLES[name] = OpTable(name)
    return _TABLES[name]
