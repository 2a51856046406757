"""Balanced mirror CP split: piece ownership, order restore, and a CP causal attention that equals
the single-rank one."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from deepinfer_parallel import (
    all_gather_restore,
    init_parallel,
    mirror_split,
    mirror_split_plan,
    restore_order,
)  # noqa: E402
from deepinfer_parallel.launch import run_distributed  # noqa: E402
from par_moe_reference import assert_close  # noqa: E402

SEQ_LENS = [7, 12, 3, 16]


def test_rank_owns_pieces_r_and_mirror():
    # One sequence of 16 tokens, cp=2: ps=4, pieces [0-3],[4-7],[8-11],[12-15].
    assert mirror_split_plan([16], 2, 0).index.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert mirror_split_plan([16], 2, 1).index.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_padding_and_equal_lengths():
    # L=7, cp=2: ps=2, pieces [0,1],[2,3],[4,5],[6,pad].
    plans = [mirror_split_plan([7], 2, r) for r in range(2)]
    assert plans[0].index.tolist() == [0, 1, 6, -1]
    assert plans[1].index.tolist() == [2, 3, 4, 5]
    assert plans[0].positions.tolist() == [0, 1, 6, -1]
    assert {p.local_len for p in plans} == {4}


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_then_restore_is_identity(cp):
    x = torch.arange(sum(SEQ_LENS) * 2, dtype=torch.float64).reshape(-1, 2)
    shards = [mirror_split(x, SEQ_LENS, cp, r)[0] for r in range(cp)]
    assert len({s.shape[0] for s in shards}) == 1
    assert torch.equal(restore_order(torch.cat(shards), SEQ_LENS, cp), x)
    # Every real token is owned by exactly one rank.
    owned = sorted(i for r in range(cp) for i in mirror_split_plan(SEQ_LENS, cp, r).index.tolist() if i >= 0)
    assert owned == list(range(sum(SEQ_LENS)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank must be in \\[0, cp_size=2\\), got 2"):
        mirror_split_plan([4], 2, 2)
    with pytest.raises(ValueError, match="cp_size must be an integer >= 1"):
        mirror_split_plan([4], 0, 0)
    with pytest.raises(ValueError, match="tokens has 3 rows but sum\\(seq_lens\\) = 4"):
        mirror_split(torch.zeros(3, 2), [4], 2, 0)


def _weights(dim=8):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(dim, dim, generator=g, dtype=torch.float64) / dim**0.5 for _ in range(3)]


def causal_attention(q, k, v, q_pos, q_seq, k_pos, k_seq):
    """Single-head causal attention within each sequence, naive float64."""
    mask = (k_seq[None, :] == q_seq[:, None]) & (k_pos[None, :] <= q_pos[:, None])
    scores = (q @ k.T) / q.shape[1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def single_rank(x):
    wq, wk, wv = _weights()
    pos = torch.cat([torch.arange(n) for n in SEQ_LENS])
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(SEQ_LENS)])
    return causal_attention(x @ wq, x @ wk, x @ wv, pos, seq, pos, seq)


def cp_forward(x, cp_handle):
    """CP prefill: local Q/K/V on this rank's pieces, KV all-gathered, outputs gathered and restored."""
    wq, wk, wv = _weights()
    local, plan = mirror_split(x, SEQ_LENS, cp_handle.size, cp_handle.rank_in_group)
    k = all_gather_restore(local @ wk, plan, cp_handle.group)
    v = all_gather_restore(local @ wv, plan, cp_handle.group)
    pos = torch.cat([torch.arange(n) for n in SEQ_LENS])
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(SEQ_LENS)])
    out = torch.zeros(plan.local_len, x.shape[1], dtype=x.dtype)
    valid = plan.valid
    out[valid] = causal_attention(
        (local @ wq)[valid], k, v, plan.positions[valid], plan.seq_ids[valid], pos, seq
    )
    return all_gather_restore(out, plan, cp_handle.group)


def _cp_worker(rank, world):
    total = sum(SEQ_LENS)
    # dp=2 x cp=2: each CP group (one DP replica) runs its own batch.
    state = init_parallel(dp=2, cp=2, ep=4)
    dp_index = state.dp.rank_in_group
    x = torch.randn(total, 8, generator=torch.Generator().manual_seed(dp_index), dtype=torch.float64)
    assert_close(cp_forward(x, state.cp), single_rank(x))
    # cp=4 over the whole world (pieces padded: 3-token sequence over 8 pieces).
    state = init_parallel(dp=1, cp=4, ep=4)
    x = torch.randn(total, 8, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert_close(cp_forward(x, state.cp), single_rank(x))


@pytest.mark.distributed
def test_cp_prefill_attention_equals_single_rank():
    run_distributed(_cp_worker, 4)
