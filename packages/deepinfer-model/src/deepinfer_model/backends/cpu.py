"""CPU reference ops: the registry's `cpu` entries delegate to `deepinfer_model.layers`.

Each wrapper only adapts the calling convention (tensors in the engine's dtypes in, the same dtype
out); the math and its rounding points are the reference blocks'. These functions are plain torch and
also run on CUDA tensors (slowly, in FP64), which is how ops without an NVIDIA kernel are served.
"""

from __future__ import annotations

import torch

from .. import batch_invariant
from ..layers import attention, mhc, norm, rope
from ..layers.engram import engram_gate as _engram_gate
from ..layers.experts import clamped_swiglu, grouped_swiglu, grouped_swiglu_sum, pair_tiled_products
from ..layers.indexer import block_max_reference, topk_indices_reference, topk_keys_reference
from ..numerics import KERNEL_ROUNDINGS, linear, round_to, weight_as
from ..ops.kv_format import store_fp8_tokens, unpack_fp8_tokens
from ..ops.registry import register
from ..quant import dequant_fp8_block, fake_quant_fp8

FP8_BLOCK = 128  # DeepGEMM's SM90 granularity: 1x128 activation groups, 128x128 weight blocks


def _act(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"activation (output) dtype must be float32 or bfloat16, got {dtype}")
    return dtype


def _out(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """The output dtype: `out_dtype`, else `x`'s (FP64 inputs, the model's carrier, need `out_dtype`)."""
    return _act(out_dtype if out_dtype is not None else x.dtype)


@register("cpu", "rms_norm")
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    out = _out(x, out_dtype)
    return norm.rms_norm(x, weight, eps, out).to(out)


@register("cpu", "apply_rope")
def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return rope.apply_rope(x, cos, sin, inverse).to(_out(x, out_dtype))


@register("cpu", "apply_rope_")
def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> None:
    """`apply_rope(x, cos, sin, inverse)`'s last r channels written into `x` (the rotation reads only them,
    so rotating the tail alone gives the same values); the leading channels are not touched."""
    rope.check_in_place(x, cos, sin)
    if cos.shape[-1]:
        tail = x[..., x.shape[-1] - 2 * cos.shape[-1] :]
        tail.copy_(rope.apply_rope(tail, cos, sin, inverse).to(x.dtype))


@register("cpu", "hc_mixes")
def hc_mixes(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    rms_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pre, post, comb = mhc.mixes(trunk, mhc.HCParams(fn, base, scale), hc_eps, rms_eps, iters)
    return pre.float(), post.float(), comb.float()


@register("cpu", "hc_read")
def hc_read(trunk: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    out = _out(trunk, out_dtype)
    return mhc.read(trunk, weights, out).to(out)


@register("cpu", "hc_mixes_read")
def hc_mixes_read(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    rms_eps: float,
    iters: int,
    read_weights: torch.Tensor,
    read_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        *hc_mixes(trunk, fn, base, scale, hc_eps, rms_eps, iters),
        hc_read(trunk, read_weights, read_dtype),
    )


@register("cpu", "hc_write")
def hc_write(
    y: torch.Tensor,
    trunk: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = _out(trunk, out_dtype)
    return mhc.write(y, trunk, post, comb, out).to(out)


@register("cpu", "fp8_block_linear")
def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % FP8_BLOCK:
        raise ValueError(f"fp8_block_linear needs K % {FP8_BLOCK} == 0, got K={x.shape[-1]}")
    xq = fake_quant_fp8(x, FP8_BLOCK)
    wd = dequant_fp8_block(w, w_scale.float(), (FP8_BLOCK, FP8_BLOCK))
    return linear(xq, wd, torch.bfloat16).to(torch.bfloat16)


@register("cpu", "grouped_expert_mlp")
def grouped_expert_mlp(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    weight_before_down: bool = True,
) -> torch.Tensor:
    """`layers.experts.experts_forward`'s routed loop (FP64, slot order) with the FP8 steps of spec 6.2:
    Q8 (1x128) of x and of the FP32 h, gate/up and down outputs rounded to bf16."""
    if x.shape[-1] % FP8_BLOCK or w2.shape[-1] % FP8_BLOCK:
        raise ValueError(
            f"grouped_expert_mlp needs H and I % {FP8_BLOCK} == 0, got {x.shape[-1]}, {w2.shape[-1]}"
        )
    t, k = topk_ids.shape
    i = w2.shape[-1]
    xq = fake_quant_fp8(x, FP8_BLOCK)
    out = torch.zeros(t, x.shape[1], dtype=torch.float64, device=x.device)
    for slot in range(k):
        for e in torch.unique(topk_ids[:, slot]).tolist():
            rows = (topk_ids[:, slot] == e).nonzero(as_tuple=True)[0]
            gu = linear(
                xq[rows], dequant_fp8_block(w13[e], s13[e].float(), (FP8_BLOCK, FP8_BLOCK)), torch.bfloat16
            )
            h = clamped_swiglu(gu[:, :i], gu[:, i:], limit)
            wr = topk_weights[rows, slot].double().unsqueeze(-1)
            if weight_before_down:
                h = h * wr
            hq = fake_quant_fp8(round_to(h, torch.float32), FP8_BLOCK)
            y = linear(hq, dequant_fp8_block(w2[e], s2[e].float(), (FP8_BLOCK, FP8_BLOCK)), torch.bfloat16)
            out[rows] += y if weight_before_down else round_to(y * wr, torch.float32)
    return out.float()


def _rows_operand(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float64, torch.float32):
        raise ValueError(f"x must be a 2-D float64 or float32 tensor, got {x.dtype} {tuple(x.shape)}")


def _rounded(out: torch.Tensor, round_to: torch.dtype | None) -> torch.Tensor:
    """`out` rounded to `round_to` (one of `numerics.KERNEL_ROUNDINGS`, or None) and widened back."""
    if round_to is None:
        return out
    if round_to not in KERNEL_ROUNDINGS:
        raise ValueError(f"round_to must be None, float32, bfloat16 or float16, got {round_to}")
    return out.to(round_to).to(out.dtype)


@register("cpu", "expert_swiglu")
def expert_swiglu(
    x: torch.Tensor,
    pairs: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weight_before_down: bool,
) -> torch.Tensor:
    return grouped_swiglu(x, pairs, weights, w1, w3, w2, limit, weight_before_down)


# (the grouped-GEMM reference itself: the op's contract is its signature)
expert_swiglu_sum = register("cpu", "expert_swiglu_sum")(grouped_swiglu_sum)


topk_keys = register("cpu", "topk_keys")(topk_keys_reference)
topk_indices = register("cpu", "topk_indices")(topk_indices_reference)
block_max = register("cpu", "block_max")(block_max_reference)


@register("cpu", "swiglu")
def swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    return clamped_swiglu(gate, up, limit, torch.float32).to(out_dtype or gate.dtype)


# (the reference block itself: the model's CPU results are bitwise what they were before the op existed)
engram_gate = register("cpu", "engram_gate")(_engram_gate)


@register("cpu", "rows_matmul")
def rows_matmul(x: torch.Tensor, weight: torch.Tensor, round_to: torch.dtype | None = None) -> torch.Tensor:
    """Fixed [TILE_ROWS, K] row tiles (`batch_invariant.tiled_matmul`) against the weight widened to
    x.dtype (a cached copy): the mode's device-agnostic path. `round_to`: the output rounded to that
    dtype and widened back to x.dtype."""
    _rows_operand(x)
    return _rounded(batch_invariant.tiled_matmul(x, weight_as(weight, x.dtype).t()), round_to)


@register("cpu", "pair_rows_matmul")
def pair_rows_matmul(
    x: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor, round_to: torch.dtype | None = None
) -> torch.Tensor:
    """`rows_matmul`'s tiles, one expert's weight gathered per row (FP64: the exact mode's carrier)."""
    if x.dim() != 2 or x.dtype != torch.float64:
        raise ValueError(f"x must be a 2-D float64 tensor, got {x.dtype} {tuple(x.shape)}")
    return _rounded(pair_tiled_products(x, weights, pairs), round_to)


@register("cpu", "tile_bmm")
def tile_bmm(
    a: torch.Tensor, b: torch.Tensor, ia: torch.Tensor | None = None, ib: torch.Tensor | None = None
) -> torch.Tensor:
    """torch.bmm on the CPU (one GEMM per matrix); elsewhere calls of exactly `DEVICE_BATCH` matrices
    (`batch_invariant.chunked_bmm`), the indexed matrices gathered first."""
    if (ia is None) != (ib is None):
        raise ValueError("tile_bmm: give both index tensors or neither")
    if ia is not None:
        return batch_invariant.gathered_chunked_bmm(a, b, ia, ib)
    if a.device.type == "cpu":
        return torch.bmm(a, b)
    return batch_invariant.chunked_bmm(a, b)


@register("cpu", "kv_store_fp8")
def kv_store_fp8(latent: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    store_fp8_tokens(latent, kv_cache, slots)


@register("cpu", "index_scores")
def index_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    limit: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Token blocks: FP32 scores of the BF16 values (exact products), ReLU, weighted sum over the heads;
    then the entries at or past each row's `limit` zeroed and the FP32 sums rounded to `out_dtype`."""
    gs, t, h, d = q.shape
    n = keys.shape[1]
    out = torch.empty(gs, t, n, dtype=torch.float32, device=q.device)
    step = max(1, SPARSE_PREFILL_ELEMENTS // max(gs * h * n, 1))
    k = keys.float().transpose(1, 2)
    for lo in range(0, t, step):
        b = q[:, lo : lo + step].shape[1]
        s = torch.relu(torch.bmm(q[:, lo : lo + step].float().reshape(gs, b * h, d), k)).view(gs, b, h, n)
        out[:, lo : lo + step] = (s * weights[:, lo : lo + step].float()[..., None]).sum(dim=2)
    if limit is not None:
        out.masked_fill_(torch.arange(n, device=q.device) >= limit[..., None], 0.0)
    return out if out_dtype is None else out.to(out_dtype)


# Gathered keys [rows, k, D] FP32 held at once by the reference sparse prefill attention (1 GiB).
SPARSE_PREFILL_ELEMENTS = 1 << 28


@register("cpu", "sparse_prefill_attention")
def sparse_prefill_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Row blocks: gather each row's keys, FP32 scores of the BF16 values (exact products), softmax with
    the sink, P rounded to BF16 for the weighted sum (as a BF16 attention kernel feeds its P.V product)."""
    t, k = indices.shape
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    step = max(1, SPARSE_PREFILL_ELEMENTS // max(k * kv.shape[1], 1))
    sink = sinks.float()[None, :, None]
    for lo in range(0, t, step):
        idx = indices[lo : lo + step]
        keys = kv[idx.long().clamp(min=0)].float()  # [b, k, D]; unlisted (-1) columns masked below
        s = torch.bmm(q[lo : lo + step].float(), keys.transpose(1, 2)) * scale  # [b, h, k]
        s = s.masked_fill((idx < 0)[:, None, :], float("-inf"))
        top = torch.maximum(s.amax(-1, keepdim=True), sink)
        p = torch.exp(s - top)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink - top)
        out[lo : lo + step] = (torch.bmm(p.bfloat16().float(), keys) / denom).bfloat16()
    return out


@register("cpu", "sparse_decode_attention")
def sparse_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    flat = unpack_fp8_tokens(kv_cache.reshape(-1, kv_cache.shape[-1]))
    keys = flat[indices.long().clamp(min=0)]  # [B, k, 512]; invalid slots masked below
    visible = indices >= 0
    out = attention.sink_attention(q, keys, visible, sinks, scale)
    return out.to(torch.bfloat16)
