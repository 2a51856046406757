"""DeepEP dispatch / combine against the torch all-to-all backend and a float64 reference (needs 2 GPUs and
`deep_ep`, built on the GPU machine by benchmarks/gpu/setup_ep.sh; skipped otherwise)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from deepinfer_parallel import (  # noqa: E402
    DeepEPDispatcher,
    RedundantExpertLayout,
    deep_ep_available,
    dispatch_combine,
)
from deepinfer_parallel.launch import run_distributed  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not deep_ep_available(),
        reason="needs 2 GPUs and deep_ep",
    ),
]

INTER, EXPERTS, TOP_K, REDUNDANT = 256, 16, 6, 2


def _worker(rank, world, tokens_per_rank, hidden):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(7)  # same weights on every rank
    w1 = (torch.randn(EXPERTS, INTER, hidden, generator=g) * hidden**-0.5).to(dev)
    w2 = (torch.randn(EXPERTS, hidden, INTER, generator=g) * INTER**-0.5).to(dev)
    layout = RedundantExpertLayout(EXPERTS, REDUNDANT, world, num_layers=1, device=dev)
    local = torch.tensor(layout.local_logical(0, rank), device=dev)
    lw1, lw2 = w1[local], w2[local]
    t = tokens_per_rank[rank]
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(t, hidden, generator=gen).to(dev).bfloat16()
    scores = torch.rand(t, EXPERTS, generator=gen).to(dev)
    scores[:, :3] += 1.0  # skewed: experts 0-2 hot (their replicas spread the load)
    weights, ids = scores.topk(TOP_K, dim=1)
    weights = weights / weights.sum(1, keepdim=True)

    def expert(slot, rows):  # float32 expert of one local slot
        return torch.relu(rows.float() @ lw1[slot].T) @ lw2[slot].T

    # float64 reference over the full (logical) expert set, this rank's tokens
    ref = torch.zeros(t, hidden, dtype=torch.float64, device=dev)
    for k in range(TOP_K):
        e = ids[:, k]
        h = torch.relu(torch.einsum("th,tih->ti", x.double(), w1[e].double()))
        ref += weights[:, k : k + 1].double() * torch.einsum("ti,thi->th", h, w2[e].double())

    torch_out = dispatch_combine(x.float(), ids, weights, expert, layout.layer(0))
    count = torch.zeros(layout.slots_per_rank, dtype=torch.int64, device=dev)
    disp = DeepEPDispatcher(
        None, hidden, TOP_K, layout.num_physical, max_tokens_per_rank=max(tokens_per_rank)
    )
    try:
        deepep_out = disp.dispatch_combine(
            x,
            ids,
            weights,
            lambda s, r, w: (expert(s, r) * w.unsqueeze(1)).bfloat16(),
            layout.layer(0),
            count,
        )
        assert deepep_out.shape == (t, hidden) and deepep_out.dtype == torch.bfloat16
        if t:
            scale = ref.abs().max().item()
            torch_err = (torch_out.double() - ref).abs().max().item() / scale
            deepep_err = (deepep_out.double() - ref).abs().max().item() / scale
            assert torch_err < 1e-5, torch_err  # float32 experts, exact combine
            assert deepep_err < 2e-2, deepep_err  # bf16 rows and bf16 combine
        # every (token, choice) landed on exactly one local slot somewhere: counts sum to T*k over ranks
        total = count.sum().clone()
        torch.distributed.all_reduce(total)
        assert int(total) == sum(tokens_per_rank) * TOP_K
    finally:
        disp.destroy()


@pytest.mark.parametrize(
    ("tokens", "hidden"),
    [((37, 64), 512), ((0, 128), 512), ((37, 64), 200)],
    ids=["uneven", "idle-rank", "unaligned-hidden"],  # 200: rows travel zero-padded to 256 columns
)
def test_deepep_matches_torch_backend_and_float64(tokens, hidden):
    run_distributed(_worker, 2, list(tokens), hidden, backend="nccl", start_method="spawn", timeout_s=600)
