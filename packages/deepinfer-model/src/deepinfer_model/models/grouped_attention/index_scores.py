"""The indexer's scores of a group's query slots against each sequence's index keys."""

from __future__ import annotations

import torch

from ... import batch_invariant
from ...numerics import attention_operands, bmm_operand, carrier, narrow_act, native
from ...ops.model_calls import fused_kernel
from . import sizes
from .groups import Group
from .products import _shared_keys


def grouped_index_scores(
    qi: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    g: Group,
    scaled: bool,
    act_dtype: torch.dtype = torch.float32,
    ratio: int | None = None,
):
    """Index scores [G*Q, n] (as `layers.indexer.index_scores`, batched over the group's sequences):
    packed `qi` [N, n_i, d_i] and `head_w` [N, n_i] against each sequence's index keys [G, n, d_i].
    Native mode: `q . k` on `attention_operands(act_dtype)` operands with FP32 accumulation.

    `ratio` (the keys are the layer's compressed entries, entry j at column j): entries a query slot at
    position p cannot see (j >= (p + 1) // ratio, `compressed_entries`' `valid`) may come back 0 instead of
    their score (the fused kernel skips them): callers mask them. Where the fused kernel serves and
    `narrow_act(act_dtype)`, the scores come back in `act_dtype` (rounded in the kernel: the values
    `round_narrow` gives), else in FP32 / the carrier."""
    n_heads, head_dim = qi.shape[1], qi.shape[2]

    def weighted(s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Relu'd scores s [G, q, n_i, n] of query slots `rows` -> head-weighted sums [G, q, n]."""
        w = head_w[rows].to(carrier())
        if scaled:
            s = s * head_dim**-0.5
            w = w * n_heads**-0.5
        return (s * w.unsqueeze(-1)).sum(dim=2)

    if batch_invariant.enabled():  # fixed-shape dot products (entries padded to whole tiles)
        gq = g.rows.shape
        flat = qi[g.rows].reshape(gq[0], -1, head_dim)
        if batch_invariant.marked_fp32_valued(qi):
            batch_invariant.mark_fp32_valued(flat)
        exact = batch_invariant.exact_scores_apply(flat, keys)  # the same bits, without padded tiles
        score = batch_invariant.row_scores if exact else batch_invariant.tiled_scores
        s = torch.relu(score(flat, keys).view(*gq, n_heads, -1))
        return weighted(s, g.rows).reshape(-1, keys.shape[1])
    # query blocks, as in `attend`: a long chunk's [G, Q, n_i, n] scores would not fit
    nat = native()
    op = attention_operands(act_dtype)
    keys = bmm_operand(keys, op) if nat else keys.to(carrier())
    kernel = None
    if nat and not scaled and op == torch.bfloat16:  # the backend's fused kernel: no [G, Q, n_i, n] scores
        kernel = fused_kernel("index_scores", qi, n_heads, head_dim)
    if kernel is not None:
        w = head_w[g.rows].to(carrier())
        limit = None if ratio is None else torch.div(g.q_pos + 1, ratio, rounding_mode="floor")
        out_dtype = act_dtype if narrow_act(act_dtype) else None
        return kernel(bmm_operand(qi[g.rows], op), keys, w, limit, out_dtype).reshape(-1, keys.shape[1])
    per_query = g.rows.shape[0] * n_heads * keys.shape[1]
    if g.rows.shape[1] * per_query <= sizes.SCORE_BLOCK_ELEMENTS:
        # one block (every decode step) without computing a block size: under torch.compile a size computed
        # from the symbolic row count is specialised, which recompiled the compiled decode step per bucket
        row_blocks = [g.rows]
    else:
        block = max(1, sizes.SCORE_BLOCK_ELEMENTS // max(per_query, 1))
        row_blocks = [g.rows[:, lo : lo + block] for lo in range(0, g.rows.shape[1], block)]
    out = []
    for rows in row_blocks:
        if nat:
            s = torch.relu(_shared_keys(bmm_operand(qi[rows], op), keys.transpose(1, 2)))
        else:
            s = torch.relu(torch.einsum("gqhd,gnd->gqhn", qi[rows].to(carrier()), keys))
        out.append(weighted(s, rows))
    return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).reshape(-1, keys.shape[1])
