"""V4.1 index keys and candidate blocks (spec v41-model §4.5, §4.6).

Index keys are projected from the KV segment's normalised compressed latent (not from the hidden as in
the public V4). Candidate blocks let later index-source layers score only a few blocks of compressed
tokens chosen once, at the candidate source layer, by their best index score.
"""

from __future__ import annotations

import torch

from ...config import RopeSpec
from ...layers.indexer import select_topk
from ...layers.rope import cos_sin
from ...numerics import carrier, linear
from ...ops import model_calls
from ...ops.model_calls import rms_norm

_BF16_MAX = torch.finfo(torch.bfloat16).max


def index_keys(
    pre_rope: torch.Tensor,
    positions: torch.Tensor,
    wk: torch.Tensor,
    k_norm: torch.Tensor,
    rope: RopeSpec,
    eps: float,
    act_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[n, d_i] = RoPE(RMSNorm_{k_norm}(wk · pre_rope_kv_j)) at the block position j·r of each entry."""
    k = rms_norm(linear(pre_rope, wk, act_dtype), k_norm, eps, act_dtype)
    cos, sin = cos_sin(rope, positions)
    return model_calls.rope(k, cos, sin, act_dtype)


def candidate_blocks(
    scores: torch.Tensor, valid: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """Candidate block ids [T, topk_blocks] (ascending, -1 padded) from index scores [T, n] over valid entries.

    A block's score is the max of its valid entries (clamped at the BF16 max); the newest (possibly
    partial) block of each query always wins (+inf). Ties go to the lower block id.

    The max is exact in any float dtype, so it runs on the scores as they are (no widened [T, n] copy, ~1 GB
    at 16k tokens); BF16 block scores stay BF16 (the BF16 max and +inf are BF16 values: `select_topk`'s
    16-bit path), others are widened to the carrier after the max (FP16 cannot hold the BF16 max clamp).
    """
    nb = -(-scores.shape[1] // block_size)
    # the blocks' max and each row's valid count in one pass over [T, n] (the registry's `block_max`: a
    # Triton kernel on the GPU, where torch's masked copy, padding, max over 16-entry blocks and count took
    # ~3.8 ms of a 16k-token medium prefill on an H100)
    block_score, klen = model_calls.ops_for(scores).block_max(scores, valid, block_size)
    if block_score.dtype is not torch.bfloat16:
        block_score = block_score.to(carrier())
    block_score = block_score.clamp(max=_BF16_MAX)
    # (klen: valid entries are a prefix j < (p+1)//r)
    n_blocks = -(-klen // block_size)
    ids = torch.arange(nb, device=scores.device)[None, :]
    newest = ids == (n_blocks - 1)[:, None]
    block_score = torch.where(newest, torch.full_like(block_score, float("inf")), block_score)
    return select_topk(block_score, ids < n_blocks[:, None], topk_blocks)


def candidate_mask(blocks: torch.Tensor, n_entries: int, block_size: int) -> torch.Tensor:
    """[T, n] bool: entry j lies in one of the query's candidate blocks (`blocks` [T, k], -1 = none)."""
    t = blocks.shape[0]
    nb = -(-n_entries // block_size)
    mask = torch.zeros(t, nb + 1, dtype=torch.bool, device=blocks.device)
    mask.scatter_(1, torch.where(blocks >= 0, blocks, torch.full_like(blocks, nb)), True)
    return mask[:, :nb].repeat_interleave(block_size, dim=1)[:, :n_entries]
