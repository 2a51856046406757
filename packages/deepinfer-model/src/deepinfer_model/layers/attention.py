"""MQA attention over one shared latent (K = V), with per-head sinks, and its projections.

The core (`sink_attention`) takes explicit keys and a visibility mask, so a KV cache (paged runtime,
decode) can feed it the same keys a whole-sequence forward builds; `sliding_window_visible` and
`compressed_visible` are the two visibility rules, expressed over absolute positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import batch_invariant
from ..numerics import (
    attention_operands,
    bmm_f32,
    bmm_operand,
    carrier,
    linear,
    native,
    round_narrow,
    weight_as,
)
from ..ops.model_calls import rms_norm, rope


@dataclass
class AttentionWeights:
    """Dequantised projections of one attention layer (upstream names in comments)."""

    wq_a: torch.Tensor  # attn.wq_a   [Rq, H]
    q_norm: torch.Tensor  # attn.q_norm [Rq]
    wq_b: torch.Tensor  # attn.wq_b   [nh*D, Rq]
    wkv: torch.Tensor  # attn.wkv    [D, H]
    kv_norm: torch.Tensor  # attn.kv_norm [D]
    wo_a: torch.Tensor  # attn.wo_a   [G*Ro, nh*D/G]
    wo_b: torch.Tensor  # attn.wo_b   [H, G*Ro]
    sinks: torch.Tensor  # attn.attn_sink [nh] FP32 logits


def sliding_window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Tq, Tk] bool: key at `k` is visible to the query at `p` iff `p - window < k <= p` (W keys incl. itself)."""
    q, k = q_pos[:, None], k_pos[None, :]
    return (k <= q) & (k > q - window)


def compressed_visible(q_pos: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """[Tq, n] bool: compressed entry `j` (tokens j*r .. j*r+r-1) exists for the query at `p` iff j < (p+1)//r."""
    j = torch.arange(n_entries, device=q_pos.device)
    return j[None, :] < torch.div(q_pos[:, None] + 1, ratio, rounding_mode="floor")


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Softmax attention with one shared latent as key and value and a per-head sink logit.

    q [T, nh, D], keys [T, S, D] (per-query key set) or [S, D] (shared), visible [T, S] bool,
    sinks [nh]. The sink is an extra logit with a zero value vector; a query with no visible key
    returns zeros. Returns unrounded [T, nh, D] in the carrier dtype: FP64 in exact mode; in native
    mode FP32, with the score and P.V products taken on `numerics.attention_operands(act_dtype)`
    operands (BF16 for BF16 activations: P is rounded to BF16, as a BF16 attention kernel does).
    """
    if native():
        return _sink_attention_native(q, keys, visible, sinks, scale, attention_operands(act_dtype))
    q, keys = q.to(carrier()), keys.to(carrier())
    if keys.dim() == 2:
        scores = torch.einsum("thd,sd->ths", q, keys) * scale
    else:
        scores = torch.einsum("thd,tsd->ths", q, keys) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.to(carrier())[None, :, None].expand(scores.shape[0], -1, 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    if keys.dim() == 2:
        return torch.einsum("ths,sd->thd", probs, keys)
    return torch.einsum("ths,tsd->thd", probs, keys)


def _sink_attention_native(q, keys, visible, sinks, scale, op) -> torch.Tensor:
    """Native `sink_attention`: `op` operand products with FP32 accumulation, FP32 softmax and sink."""
    t, nh, d = q.shape
    qo = bmm_operand(q, op)  # [T, nh, D]
    ko = bmm_operand(keys, op)
    if keys.dim() == 2:  # one key set for every query: a single [T*nh, D] x [D, S] product
        scores = bmm_f32(qo.reshape(1, t * nh, d), ko.t()[None]).view(t, nh, -1)
    else:
        scores = bmm_f32(qo, ko.transpose(1, 2))
    scores = (scores * scale).masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.to(torch.float32)[None, :, None].expand(t, -1, 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = bmm_operand(torch.softmax(logits, dim=-1)[..., :-1], op)
    if keys.dim() == 2:
        return bmm_f32(probs.reshape(1, t * nh, -1), ko[None]).view(t, nh, d)
    return bmm_f32(probs, ko)


def project_query(
    y: torch.Tensor,
    w: AttentionWeights,
    num_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    head_norm: bool,
    act_dtype: torch.dtype = torch.float32,
    narrow: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, nh, D] with RoPE on its tail, q_lat [T, Rq] = normed low-rank query that the indexer reuses).
    `narrow`: q as an act-dtype tensor where `numerics.narrow_act` (for callers whose attention takes it:
    q is the largest activation of a prefill step, [T, 64, 512] on V4.1)."""
    q_lat = rms_norm(linear(y, w.wq_a, act_dtype), w.q_norm, eps, act_dtype)
    q = linear(q_lat, w.wq_b, act_dtype, narrow=narrow and not head_norm).view(y.shape[0], num_heads, -1)
    if head_norm:  # public V4 only: unweighted RMSNorm of every head
        q = rms_norm(q, None, eps, act_dtype)
    # (q is this function's own fresh GEMM / norm output: rotated in place where `rope` can)
    return rope(q, cos, sin, act_dtype, narrow=narrow, inplace=True), q_lat


def project_latent(
    y: torch.Tensor,
    w: AttentionWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The token's own (sliding-window) latent [T, D]: wkv -> kv_norm -> RoPE on the tail."""
    kv = rms_norm(linear(y, w.wkv, act_dtype), w.kv_norm, eps, act_dtype)
    return rope(kv, cos, sin, act_dtype)


def project_output(
    o: torch.Tensor,
    w: AttentionWeights,
    o_groups: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    act_dtype: torch.dtype = torch.float32,
    narrow: bool = False,
) -> torch.Tensor:
    """Attention output [T, nh, D] -> [T, H]: conjugate RoPE on the tail, grouped wo_a, then wo_b.
    `narrow`: the result as an act-dtype tensor where `numerics.narrow_act` (for callers whose consumers
    take it: the mHC write). `o` is consumed: its tail may be rotated in place (`ops.model_calls.rope`)."""
    t = o.shape[0]
    # (the grouped GEMM's operand, below). `o` is handed over: every caller passes the attention output it
    # has just computed (or its rounding) and reads it no more, so `rope` may rotate it in place
    o = rope(o, cos, sin, act_dtype, inverse=True, narrow=True, inplace=True)
    grouped = o.reshape(t, o_groups, -1)  # group g = heads g*nh/G .. (g+1)*nh/G - 1
    # GEMM operands as in `linear`: FP64 (exact) or act_dtype (native: a BF16 GEMM, FP32 accumulation)
    gemm = act_dtype if native() else torch.float64
    grouped = grouped.to(gemm)
    wo_a = weight_as(w.wo_a, gemm).view(o_groups, -1, grouped.shape[-1])  # [G, Ro, nh*D/G]
    parts = None
    if batch_invariant.enabled() and grouped.device.type == "cpu" and gemm == torch.float64:
        parts = batch_invariant.stacked_parts(w.wo_a, groups=o_groups)
    if parts is not None and t:
        # every group in one call (`grouped_gemm`: exact products, each row's bits independent of T and
        # of the other rows): rows ordered by group, group g against its [nh*D/G, Ro] block
        rows = grouped.transpose(0, 1).reshape(o_groups * t, -1)
        fp32 = batch_invariant.marked_fp32_valued(o)  # (rounded by `rope`: no test of every value)
        z = batch_invariant.grouped_gemm(rows, [t] * o_groups, parts, fp32_valued=fp32)[:, : wo_a.shape[1]]
        z = z.view(o_groups, t, -1).transpose(0, 1)
    elif batch_invariant.enabled():  # one row-invariant GEMM per group instead of a batched einsum over T
        z = torch.stack([batch_invariant.matmul(grouped[:, g], wo_a[g].t()) for g in range(o_groups)], 1)
    elif native() and t and not torch.compiler.is_compiling() and not _tracks_grad(grouped, wo_a):
        # (dynamo rejects a strided `out=`, autograd any `out=`: a training step takes the einsum)
        # one batched GEMM over the groups reading o in place (group g's rows are `grouped[:, g]`, a
        # row-major matrix with leading dimension G*nh*D/G), its output written straight into [T, G, Ro]
        # order: the einsum below permutes o into a [G, T, ...] copy first ([T, 64, 512] BF16 on V4.1,
        # 1 GiB at 16k tokens) and the output back
        z = grouped.new_empty(t, o_groups, wo_a.shape[1])
        torch.bmm(grouped.transpose(0, 1), wo_a.transpose(1, 2), out=z.transpose(0, 1))
    else:
        z = torch.einsum("tgi,gri->tgr", grouped, wo_a)
    # (native BF16: the grouped GEMM's output is already rounded, and wo_b takes it as it is)
    z = round_narrow(z, act_dtype).reshape(t, -1)
    return linear(z, w.wo_b, act_dtype, narrow=narrow)


def _tracks_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a product of these tensors (a training step through the model)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
