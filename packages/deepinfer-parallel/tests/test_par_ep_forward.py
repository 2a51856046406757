"""EP forward (dispatch / combine over gloo) equals the single-process forward of the same MoE layer."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from deepinfer_parallel import RedundantExpertLayout, dispatch_combine  # noqa: E402
from deepinfer_parallel.launch import run_distributed  # noqa: E402
from par_moe_reference import E, H, assert_close, make_weights, moe_reference, route, swiglu  # noqa: E402

TOKENS_PER_RANK = [5, 0, 9, 4]  # rank 1 has an empty batch: it must still take part


def ep_moe(x, layer, layout, ep_rank, group=None, expert_count=None):
    """The layer as the model runs it under EP: local shared expert + dispatched routed experts."""
    local = layout.local_logical(0, ep_rank)

    def local_expert_fn(slot, tokens):
        e = local[slot]
        return swiglu(tokens, layer["w1"][e], layer["w3"][e], layer["w2"][e])

    ids, weights = route(x, layer)
    routed = dispatch_combine(x, ids, weights, local_expert_fn, layout.layer(0), group, expert_count)
    return swiglu(x, layer["s1"], layer["s3"], layer["s2"]) + routed


def _ep_worker(rank, world, num_redundant):
    layer = make_weights(seed=1, hot=(0, 1))[0]
    x = torch.randn(
        TOKENS_PER_RANK[rank], H, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64
    )
    layout = RedundantExpertLayout(E, num_redundant, world)
    count = torch.zeros(layout.slots_per_rank, dtype=torch.int64)
    out = ep_moe(x, layer, layout, rank, expert_count=count)
    assert_close(out, moe_reference(x, layer))

    # Every routed (token, choice) row was processed exactly once somewhere.
    all_counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(all_counts, count)
    per_slot = torch.cat(all_counts)
    assert int(per_slot.sum()) == sum(TOKENS_PER_RANK[:world]) * 3
    if num_redundant:
        # The hot experts 0 and 1 have replicas (slots E, E+1); the replica rule must use them.
        assert int(per_slot[E]) > 0 and int(per_slot[E + 1]) > 0


@pytest.mark.distributed
def test_ep2_forward_equals_single_process():
    run_distributed(_ep_worker, 2, 0)


@pytest.mark.distributed
def test_ep4_with_redundant_replicas_equals_single_process():
    run_distributed(_ep_worker, 4, 4)  # 8 experts + 4 replicas = 3 slots per rank


def test_replica_rule_matches_spec():
    layout = RedundantExpertLayout(8, 8, 4)  # every expert has 2 replicas: slots e and 8+e
    ids = torch.tensor([[0, 3], [0, 3], [5, 7]])
    for ep_rank in range(4):
        phys = layout.layer(0).physical_of(ids, ep_rank)
        for row in range(3):
            for j in range(2):
                e = int(ids[row, j])
                replica = (ep_rank + row * 23333) % 2
                assert int(phys[row, j]) == [e, 8 + e][replica]


def test_layout_rejects_sizes_not_divisible():
    with pytest.raises(ValueError, match="8 \\+ 3 = 11 must be divisible by ep_size=4"):
        RedundantExpertLayout(8, 3, 4)
