"""The same EP forward and EPLB shuffle on NCCL with CUDA tensors (needs 2 GPUs; skipped otherwise)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from deepinfer_parallel import EplbConfig, EplbState, RedundantExpertLayout, dispatch_combine  # noqa: E402
from deepinfer_parallel.launch import run_distributed  # noqa: E402
from par_moe_reference import E, H, assert_close, make_weights, model_reference, route, swiglu  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _nccl_worker(rank, world):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    layers = [{k: v.to(dev) for k, v in layer.items()} for layer in make_weights(2, seed=3, hot=(5, 6, 7))]
    layout = RedundantExpertLayout(E, 2, world, num_layers=2, device=dev)
    local_weights = [
        [layer[n][layout.local_logical(i, rank)].clone() for n in ("w1", "w3", "w2")]
        for i, layer in enumerate(layers)
    ]
    state = EplbState(layout, EplbConfig(interval=4, window=1), expert_weights=local_weights)
    x = torch.randn(10 + 3 * rank, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).to(
        dev
    )
    expected = model_reference(x, layers)
    reports = []
    for _ in range(3):  # first rebalance at step 1 (interval 4: quarter period)
        h = x
        for i, layer in enumerate(layers):
            w1, w3, w2 = local_weights[i]
            ids, weights = route(h, layer)
            routed = dispatch_combine(
                h, ids, weights, lambda s, t, w1=w1, w3=w3, w2=w2: swiglu(t, w1[s], w3[s], w2[s]),
                layout.layer(i), None, state.expert_count[i],
            )  # fmt: skip
            h = h + swiglu(h, layer["s1"], layer["s3"], layer["s2"]) + routed
        assert_close(h, expected, tol=1e-10)
        reports.append(state.step())
    assert reports[0] is not None and reports[0].layers_changed > 0 and reports[0].bytes_moved_total > 0


def test_ep_and_eplb_shuffle_on_nccl():
    run_distributed(_nccl_worker, 2, backend="nccl", start_method="spawn", timeout_s=300)
