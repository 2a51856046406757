"""Routed experts with one host sync per layer, and host-side token-id validation of the paged runtime.

`experts_forward` sorts the (token, slot) pairs by expert and reads back only the per-expert counts;
it is checked against a float64 naive per-(token, slot) loop written from the definition (not from
the layer code), and it must issue no `nonzero` / `unique` / `item`. A bad token id in a paged step is
rejected on the host by `StepMetadata.build` with the sequence, the id and the vocabulary range.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_model.layers import ExpertWeights, MLPWeights, experts_forward
from deepinfer_model.layers.embedding import embed
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime.metadata import StepMetadata
from torch.profiler import ProfilerActivity, profile

LIMIT = 0.9  # small enough that the clamps are active on some entries of the random activations
SYNC_OPS = ("aten::nonzero", "aten::_unique2", "aten::item", "aten::_local_scalar_dense")


def _problem(t: int, k: int, n_experts: int, h: int = 16, i: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g, dtype=torch.float64).float().double()  # FP32 values, FP64 carrier
    ids = (
        torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(t)])
        if t
        else torch.empty(0, k, dtype=torch.long)
    )
    weights = torch.rand(t, k, generator=g) + 0.1
    ex = ExpertWeights(
        torch.randn(n_experts, i, h, generator=g) / h**0.5,
        torch.randn(n_experts, i, h, generator=g) / h**0.5,
        torch.randn(n_experts, h, i, generator=g) / i**0.5,
    )
    shared = MLPWeights(
        torch.randn(i, h, generator=g) / h**0.5,
        torch.randn(i, h, generator=g) / h**0.5,
        torch.randn(h, i, generator=g) / i**0.5,
    )
    return x, weights, ids, ex, shared


def _r32(v: torch.Tensor) -> torch.Tensor:
    return v.float().double()


def _swiglu64(x: torch.Tensor, w1, w3, limit: float) -> torch.Tensor:
    gate = _r32(w1.double() @ x).clamp(max=limit)
    up = _r32(w3.double() @ x).clamp(-limit, limit)
    return gate / (1.0 + torch.exp(-gate)) * up


def _naive(x, weights, ids, ex, shared, limit, weight_before_down) -> torch.Tensor:
    """FP64, one (token, slot) pair at a time, matrix-vector products, FP32 rounding at each stored value."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for s in range(ids.shape[1]):
            e, w = int(ids[t, s]), float(weights[t, s])
            h = _swiglu64(x[t], ex.w1[e], ex.w3[e], limit)
            if weight_before_down:
                acc = acc + _r32(ex.w2[e].double() @ (h * w))
            else:
                acc = acc + _r32(ex.w2[e].double() @ h) * w
        if shared is not None:
            acc = acc + _r32(shared.w2.double() @ _swiglu64(x[t], shared.w1, shared.w3, limit))
        out[t] = _r32(acc)
    return out


@pytest.mark.parametrize("weight_before_down", [False, True])
@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize(("t", "k", "n_experts"), [(1, 2, 8), (13, 3, 16), (40, 6, 8), (0, 2, 4)])
def test_routed_experts_match_float64_per_pair_loop(
    monkeypatch, t, k, n_experts, with_shared, weight_before_down
):
    monkeypatch.delenv("DEEPINFER_NUMERICS", raising=False)  # exact numerics (FP64 carrier)
    x, weights, ids, ex, shared = _problem(t, k, n_experts, seed=t * 100 + k)
    shared = shared if with_shared else None
    got = experts_forward(x, weights, ids, ex, shared, LIMIT, torch.float32, weight_before_down)
    ref = _naive(x, weights, ids, ex, shared, LIMIT, weight_before_down)
    assert got.shape == (t, x.shape[1]) and got.dtype == torch.float64
    # matrix-vector vs GEMM FP64 sums may differ in their last FP64 bits, which can flip an FP32 rounding
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-7)
    if t:
        assert (got == ref).double().mean() > 0.95  # nearly every entry is bitwise equal


def test_routed_experts_bitwise_independent_of_grouping(monkeypatch):
    """Each (token, slot) result only depends on that pair: a token alone gives its rows of the batch."""
    monkeypatch.delenv("DEEPINFER_NUMERICS", raising=False)
    x, weights, ids, ex, shared = _problem(24, 4, 8, seed=7)
    full = experts_forward(x, weights, ids, ex, shared, LIMIT, torch.float32, True)
    for row in (0, 11, 23):
        one = experts_forward(
            x[row : row + 1],
            weights[row : row + 1],
            ids[row : row + 1],
            ex,
            shared,
            LIMIT,
            torch.float32,
            True,
        )
        assert torch.equal(one[0], full[row])


def test_routed_experts_make_no_boolean_mask_or_item_syncs():
    x, weights, ids, ex, shared = _problem(32, 4, 16, seed=3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        experts_forward(x, weights, ids, ex, shared, LIMIT, torch.float32, True)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert {op: counts.get(op, 0) for op in SYNC_OPS} == dict.fromkeys(SYNC_OPS, 0)
    assert counts.get("aten::bincount", 0) == 1  # the one count read back per call


def test_routed_experts_reject_expert_ids_beyond_the_weights():
    x, weights, ids, ex, shared = _problem(4, 2, 8, seed=1)
    ids[2, 1] = 9
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\), got an id 9"):
        experts_forward(x, weights, ids, ex, shared, LIMIT)


def test_embed_checked_skips_the_device_check_unchecked_keeps_it():
    table = torch.randn(10, 4)
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, vocab_size=10\), got range \[3, 10\]"):
        embed(torch.tensor([3, 10]), table)
    ids = torch.tensor([0, 9, 4])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = embed(ids, table, checked=True)
    assert not any(e.key in SYNC_OPS for e in prof.key_averages())
    assert torch.equal(got, table[ids].double())


def _batch(ids_per_seq: list[list[int]]) -> StepBatch:
    qlens = np.array([len(s) for s in ids_per_seq], dtype=np.int64)
    return StepBatch.of(
        seq_ids=np.array([5, 7, 9][: len(ids_per_seq)], dtype=np.int64),
        start_positions=np.zeros(len(qlens), dtype=np.int64),
        query_lens=qlens,
        block_tables=[np.array([i], dtype=np.int64) for i in range(len(qlens))],
        input_ids=np.array([t for s in ids_per_seq for t in s], dtype=np.int64),
        logits_lens=np.ones(len(qlens), dtype=np.int64),
    )


def test_step_metadata_validates_ids_on_the_host():
    good = StepMetadata.build(_batch([[1, 2], [3, 99]]), 4, 2, vocab_size=100)
    assert good.ids_checked
    assert not StepMetadata.build(_batch([[1, 2], [3, 99]]), 4, 2).ids_checked
    with pytest.raises(ValueError, match=r"sequence 7: input_ids\[3\] = 100 .*\[0, vocab_size=100\)"):
        StepMetadata.build(_batch([[1, 2], [3, 100]]), 4, 2, vocab_size=100)
    with pytest.raises(ValueError, match=r"sequence 5: input_ids\[0\] = -1 .*\[0, vocab_size=100\)"):
        StepMetadata.build(_batch([[-1, 2], [3, 4]]), 4, 2, vocab_size=100)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint

    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41sync"), seed=0))


def test_paged_step_with_a_bad_token_id_fails_clearly(v41):
    from deepinfer_model.runtime import PagedRunner

    vocab = v41.config.vocab_size
    runner = PagedRunner(v41, num_blocks=4, block_size=16)
    with pytest.raises(
        ValueError, match=rf"sequence 9: input_ids\[4\] = {vocab} .*\[0, vocab_size={vocab}\)"
    ):
        runner.execute(_batch([[1, 2], [3], [4, vocab]]))
    # a valid step still runs, and its embedding made no device-side id check
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = runner.execute(_batch([[1, 2], [3], [4, vocab - 1]]))
    assert logits.shape == (3, vocab) and torch.isfinite(logits).all()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::item", 0) == 0 and counts.get("aten::_local_scalar_dense", 0) == 0
