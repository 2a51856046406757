"""The registry ops a compiled decode step records as `torch.library` custom ops (`compile_boundary.as_custom_op`).

An accelerator kernel is host code `torch.compile` cannot trace. Called as a plain function inside a
compiled region it breaks the graph, and every break leaves casts and elementwise ops of its own on each
side (the medium V4.1's batch-1 step on the H200 ran ~200 single-cast kernels, one or two per break). As a
custom op it is one node of the graph: inductor fuses what is around it and only needs each op's output
shapes and dtypes, which `FAKES` compute from the op's contract (`registry.OP_SPECS`).

An op that writes into an argument (`Tensor(a!)` in its schema: `apply_rope_`) is recorded as mutating it
(`mutates_args`), so the compiled graph orders its readers after the call. Only the ops of the graphed decode
step are listed; the others (prefill attention, batch-invariant GEMMs, FP8 linears) never run inside a
compiled region.
"""

from __future__ import annotations

import torch

SCHEMAS: dict[str, str] = {
    "rms_norm": "(Tensor x, Tensor? weight, float eps, ScalarType? out_dtype=None) -> Tensor",
    "apply_rope": "(Tensor x, Tensor cos, Tensor sin, bool inverse=False, ScalarType? out_dtype=None) -> Tensor",
    "apply_rope_": "(Tensor(a!) x, Tensor cos, Tensor sin, bool inverse=False) -> ()",
    "hc_mixes": "(Tensor trunk, Tensor fn, Tensor base, Tensor scale, float hc_eps, float rms_eps, int iters) "
    "-> (Tensor, Tensor, Tensor)",
    "hc_read": "(Tensor trunk, Tensor weights, ScalarType? out_dtype=None) -> Tensor",
    "hc_mixes_read": "(Tensor trunk, Tensor fn, Tensor base, Tensor scale, float hc_eps, float rms_eps, int iters, "
    "Tensor read_weights, ScalarType read_dtype) -> (Tensor, Tensor, Tensor, Tensor)",
    "hc_write": "(Tensor y, Tensor trunk, Tensor post, Tensor comb, ScalarType? out_dtype=None) -> Tensor",
    "index_scores": "(Tensor q, Tensor keys, Tensor weights, Tensor? limit=None, ScalarType? out_dtype=None) "
    "-> Tensor",
    "expert_swiglu": "(Tensor x, Tensor pairs, Tensor weights, Tensor w1, Tensor w3, Tensor w2, float limit, "
    "bool weight_before_down) -> Tensor",
    "expert_swiglu_sum": "(Tensor x, Tensor pairs, Tensor weights, Tensor w1, Tensor w3, Tensor w2, float limit, "
    "bool weight_before_down, Tensor? addend, ScalarType act_dtype, ScalarType out_dtype) -> Tensor",
    "swiglu": "(Tensor gate, Tensor up, float limit, ScalarType? out_dtype=None) -> Tensor",
    "block_max": "(Tensor scores, Tensor valid, int block) -> (Tensor, Tensor)",
    "engram_gate": "(Tensor trunk, Tensor k, Tensor v, Tensor qk, Tensor image, float eps, ScalarType act_dtype, "
    "ScalarType out_dtype) -> Tensor",
}


def _rms_norm(x, weight, eps, out_dtype=None):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


def _apply_rope(x, cos, sin, inverse=False, out_dtype=None):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


def _apply_rope_(x, cos, sin, inverse=False):
    return None  # (writes into x: no output)


def _hc_mixes(trunk, fn, base, scale, hc_eps, rms_eps, iters):
    t, m = trunk.shape[0], trunk.shape[1]
    f32 = torch.float32
    return (
        trunk.new_empty(t, m, dtype=f32),
        trunk.new_empty(t, m, dtype=f32),
        trunk.new_empty(t, m, m, dtype=f32),
    )


def _hc_read(trunk, weights, out_dtype=None):
    return trunk.new_empty(trunk.shape[0], trunk.shape[2], dtype=out_dtype or trunk.dtype)


def _hc_write(y, trunk, post, comb, out_dtype=None):
    return trunk.new_empty(trunk.shape, dtype=out_dtype or trunk.dtype)


def _index_scores(q, keys, weights, limit=None, out_dtype=None):
    return q.new_empty(q.shape[0], q.shape[1], keys.shape[1], dtype=out_dtype or torch.float32)


def _expert_swiglu(x, pairs, weights, w1, w3, w2, limit, weight_before_down):
    return x.new_empty(pairs.numel(), x.shape[1], dtype=torch.float32)


def _expert_swiglu_sum(
    x, pairs, weights, w1, w3, w2, limit, weight_before_down, addend, act_dtype, out_dtype
):
    return x.new_empty(x.shape[0], w2.shape[1], dtype=out_dtype)


def _swiglu(gate, up, limit, out_dtype=None):
    return gate.new_empty(gate.shape, dtype=out_dtype or gate.dtype)


def _engram_gate(trunk, k, v, qk, image, eps, act_dtype, out_dtype):
    return trunk.new_empty(trunk.shape, dtype=out_dtype)


def _block_max(scores, valid, block):
    t, n = scores.shape
    return scores.new_empty(t, -(-n // block)), scores.new_empty(t, dtype=torch.long)


def _hc_mixes_read(trunk, fn, base, scale, hc_eps, rms_eps, iters, read_weights, read_dtype):
    t, m, h = trunk.shape
    read = trunk.new_empty(t, h, dtype=read_dtype)
    return (*_hc_mixes(trunk, fn, base, scale, hc_eps, rms_eps, iters), read)


FAKES = {
    "rms_norm": _rms_norm,
    "apply_rope": _apply_rope,
    "apply_rope_": _apply_rope_,
    "hc_mixes": _hc_mixes,
    "hc_read": _hc_read,
    "hc_mixes_read": _hc_mixes_read,
    "hc_write": _hc_write,
    "index_scores": _index_scores,
    "expert_swiglu": _expert_swiglu,
    "expert_swiglu_sum": _expert_swiglu_sum,
    "swiglu": _swiglu,
    "block_max": _block_max,
    "engram_gate": _engram_gate,
}
