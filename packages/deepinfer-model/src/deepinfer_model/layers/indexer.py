"""Lightning indexer: score compressed entries per query and keep the top-k (sparse attention selection).

`I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])` (public V4 also scales by `d_i^-1/2 * n_i^-1/2`).
Selection is deterministic: larger score first, equal scores -> lower index first; the result is
returned in ascending index order and padded with -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compile_boundary import as_custom_op, custom_ops_enabled, outside_compiled_graph
from ..numerics import attention_operands, bmm_f32, bmm_operand, carrier, linear, native
from ..ops.model_calls import rope
from .compressor import CompressorWeights


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
    """Index queries [T, n_i, d_i] with RoPE on the tail of every head (the registry's RoPE: a kernel on a GPU,
    not a dozen torch passes over [T, n_i, d_i]; as an act-dtype tensor where `numerics.narrow_act`)."""
    q = linear(q_lat, w.wq_b, act_dtype, narrow=True).view(q_lat.shape[0], n_heads, -1)
    return rope(q, cos, sin, act_dtype, narrow=True, inplace=True)  # (q: the fresh GEMM output)


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


_NARROW = (torch.bfloat16, torch.float16)
_KEY16_INVALID = -(1 << 15)  # below every score's key16 (-32767 .. 32767), NaNs included


def _select_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of the k best valid entries per row (ties -> lower index), ascending, -1 padded.

    16-bit scores (native mode's act-dtype index scores, `numerics.round_narrow`) take `_select_topk_keys`
    (a top-k of unique integer keys instead of a sort of the whole row: the sorts were ~22 of a 16k-token
    medium prefill step's 279 ms on the H200); FP32 / FP64 scores are sorted. -0.0 and +0.0 are equal
    scores; for NaN scores the selection is unspecified. The two differ only for valid -inf scores (never
    an index score): the keys rank them above every invalid entry, the sort among the invalid entries."""
    t, n = scores.shape
    if n == 0:
        return torch.full((t, k), -1, dtype=torch.long, device=scores.device)
    if scores.dtype in _NARROW and n <= 1 << 16 and k >= 1:
        from ..ops.model_calls import ops_for  # (ops -> backends -> layers: imported at call time)

        return ops_for(scores).topk_indices(scores, valid, k)  # (the reference: `_select_topk_keys`)
    if scores.dtype in _NARROW:
        return _select_topk_keys(scores, valid, k)
    return _select_topk_sorted(scores, valid, k)


def _order_keys(scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Integer keys [T, n] of 16-bit scores, unique in a row, ordered like (score desc, index asc), and the
    multiplier `shift` of the score part: key = key16 * shift + (shift - 1 - j).

    key16 maps the sign-magnitude bits to two's complement (-magnitude for negatives: -32768 - bits),
    which orders like the values and gives -0.0 and +0.0 the same key (0); an invalid entry's key16 is
    -32768, below all. int32 keys hold the index exactly while n <= 2^16 (the `topk_keys` op: one kernel on
    a GPU, where the torch version below took 3.4 ms of a [16k, 16k] call's 7.3 ms on an H100), int64 keys
    beyond."""
    if scores.shape[1] <= 1 << 16:
        from ..ops.model_calls import ops_for  # (ops -> backends -> layers: imported at call time)

        return ops_for(scores).topk_keys(scores, valid), 1 << 16
    return order_keys_torch(scores, valid)


def topk_keys_reference(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The `topk_keys` op's reference: `order_keys_torch`'s int32 keys (n <= 2^16)."""
    if scores.shape[1] > 1 << 16:
        raise ValueError(f"topk_keys: int32 keys hold at most 65536 entries per row, got {scores.shape[1]}")
    return order_keys_torch(scores, valid)[0]


def order_keys_torch(scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`_order_keys` in torch elementwise ops (any n: int64 keys past 2^16 entries). (As few kernels as
    eager torch allows: at [16k, 16k] each costs about what the top-k's passes do.)"""
    n = scores.shape[1]
    bits = scores.view(torch.int16)
    key16 = torch.where(bits < 0, -32768 - bits, bits)  # (the discarded branch wraps for bits >= 0)
    key16 = torch.where(valid, key16, _KEY16_INVALID)
    dtype, shift = (torch.int32, 1 << 16) if n <= 1 << 16 else (torch.int64, 1 << 32)
    low = (shift - 1) - torch.arange(n, dtype=dtype, device=scores.device)
    return torch.add(low, key16, alpha=shift), shift  # (one kernel: key16 is widened as it is read)


def topk_indices_reference(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """The `topk_indices` op's reference: `_select_topk_keys` on int32 keys (n <= 2^16)."""
    if scores.shape[1] > 1 << 16:
        raise ValueError(f"topk_indices: at most 65536 entries per row, got {scores.shape[1]}")
    if k < 1:
        raise ValueError(f"topk_indices: k must be >= 1, got {k}")
    return _select_topk_keys(scores, valid, k)


def block_max_reference(
    scores: torch.Tensor, valid: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `block_max` op's reference: (the max of each `block` consecutive entries' valid scores [T, nb] in
    scores' dtype, -inf where a block has none; the valid entries per row [T] int64). A max is exact in any
    float dtype, so the scores are read as they are."""
    if block < 1:
        raise ValueError(f"block_max: block must be >= 1, got {block}")
    t, n = scores.shape
    nb = -(-n // block)
    pad = nb * block - n
    if pad:  # one -inf-filled copy holds the padded row (not a masked copy, then a padded copy of that)
        s = scores.new_full((t, nb * block), float("-inf"))
        s[:, :n].copy_(scores)
        s[:, :n].masked_fill_(~valid, float("-inf"))
    else:
        s = scores.masked_fill(~valid, float("-inf"))
    return s.view(t, nb, block).amax(dim=-1), valid.sum(dim=1)


def _select_topk_keys(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """`_select_topk` of 16-bit scores: the k largest unique keys (a radix select, no full-row sort), their
    indices from the keys' low bits, then a sort of only those <= k indices. No host sync (CUDA graphs)."""
    t, n = scores.shape
    keys, shift = _order_keys(scores, valid)
    top = torch.topk(keys, min(k, n), dim=-1, sorted=False).values
    idx = (shift - 1) - (top & (shift - 1))
    idx = torch.where(top >= (_KEY16_INVALID + 1) * shift, idx, n)  # invalid -> n, sorts after every index
    idx = torch.sort(idx, dim=-1).values
    picked = torch.where(idx == n, -1, idx).long()
    if picked.shape[1] < k:
        picked = torch.cat((picked, picked.new_full((t, k - picked.shape[1]), -1)), dim=1)
    return picked


def _select_topk_sorted(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """`_select_topk` by a stable descending sort of every whole row (FP32 / FP64 scores; the reference the
    16-bit key path is tested against). 16-bit scores are sorted as they are: the same order as their
    widened values. Invalid entries are masked with -inf, so a valid -inf score ranks among them by index
    (and may be dropped for one)."""
    t, n = scores.shape
    if n == 0:
        return torch.full((t, k), -1, dtype=torch.long, device=scores.device)
    narrow = scores.dtype in _NARROW
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
