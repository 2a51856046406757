"""Lightning indexer: score compressed entries per query and keep the top-k (sparse attention selection).

`I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])` (public V4 also scales by `d_i^-1/2 * n_i^-1/2`).
Selection is deterministic: larger score first, equal scores -> lower index first; the result is
returned in ascending index order and padded with -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compile_boundary import as_custom_op, custom_ops_enabled, outside_compiled_graph
from ..numerics import attention_operands, bmm_f32, bmm_operand, carrier, linear, native, round_to
from .compressor import CompressorWeights
from .rope import apply_rope


@dataclass
class IndexerWeights:
    """`wq_b` [n_i*d_i, Rq] on the attention's normed low-rank query, `weights_proj` [n_i, H] on the layer input.

    Public V4 gives the indexer its own compressor over the hidden (`compressor`, 2*d_i wide with overlap);
    V4.1 derives index keys from the main compressed latent instead (`wk` [d_i, D], `k_norm` [d_i]).
    """

    wq_b: torch.Tensor
    weights_proj: torch.Tensor
    compressor: CompressorWeights | None = None
    wk: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def index_queries(
    q_lat: torch.Tensor,
    w: IndexerWeights,
    n_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Index queries [T, n_i, d_i] with RoPE on the tail of every head."""
    q = linear(q_lat, w.wq_b, act_dtype).view(q_lat.shape[0], n_heads, -1)
    return round_to(apply_rope(q, cos, sin), act_dtype)


def index_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_weights: torch.Tensor,
    scaled: bool,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Scores [T, n] of queries [T, n_i, d_i] against index keys [n, d_i] with head weights [T, n_i], in
    the carrier dtype (FP64 exact; native: `q . k` on `numerics.attention_operands(act_dtype)` operands
    with FP32 accumulation, the ReLU and head-weighted sum in FP32)."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    if native():
        op = attention_operands(act_dtype)
        flat = bmm_operand(q, op).reshape(1, -1, head_dim)
        s = torch.relu(bmm_f32(flat, bmm_operand(keys, op).t()[None]).view(q.shape[0], n_heads, -1))
    else:
        s = torch.relu(torch.einsum("thd,nd->thn", q.to(carrier()), keys.to(carrier())))
    w = head_weights.to(carrier())
    if scaled:
        s = s * head_dim**-0.5
        w = w * n_heads**-0.5
    return (s * w.unsqueeze(-1)).sum(dim=1)


def _select_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of the k best valid entries per row (ties -> lower index), ascending, -1 padded.

    16-bit scores (native mode's act-dtype index scores, `numerics.round_narrow`) are sorted as they are:
    the same order as their widened values, and the radix sort runs over 16-bit keys (half the passes: the
    sort was ~40 of a 16k-token medium prefill step's 370 ms on the H200)."""
    t, n = scores.shape
    if n == 0:
        return torch.full((t, k), -1, dtype=torch.long, device=scores.device)
    narrow = scores.dtype in (torch.bfloat16, torch.float16)
    masked = (scores if narrow else scores.to(carrier())).masked_fill(~valid, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    keep = valid.gather(1, order)
    picked = torch.where(keep, order, torch.full_like(order, n))  # n sorts after every real index
    picked = torch.sort(picked, dim=-1).values
    picked = torch.where(picked == n, torch.full_like(picked, -1), picked)
    if picked.shape[1] < k:
        picked = torch.cat((picked, picked.new_full((t, k - picked.shape[1]), -1)), dim=1)
    return picked


def _select_topk_fake(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    return scores.new_empty(scores.shape[0], k, dtype=torch.long)


# called, not traced, inside a compiled region: inductor's generated sort of long rows is ~4x slower than
# ATen's radix sort; recorded there as a custom op (no graph break) unless DEEPINFER_COMPILE_CUSTOM_OPS=0
select_topk = outside_compiled_graph(
    _select_topk,
    as_custom_op(
        "deepinfer::select_topk",
        _select_topk,
        "(Tensor scores, Tensor valid, int k) -> Tensor",
        _select_topk_fake,
    )
    if custom_ops_enabled()
    else None,
)


def selection_mask(selected: torch.Tensor, n_entries: int) -> torch.Tensor:
    """[T, n] bool mask of the entries listed in `selected` [T, k] (-1 = none)."""
    t = selected.shape[0]
    mask = torch.zeros(t, n_entries + 1, dtype=torch.bool, device=selected.device)
    idx = torch.where(selected >= 0, selected, torch.full_like(selected, n_entries))
    mask.scatter_(1, idx, True)
    return mask[:, :n_entries]
