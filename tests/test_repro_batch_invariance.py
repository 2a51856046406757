"""Batch-invariant mode: a request's logits are bitwise identical whatever else is in the batch, however
its prompt is chunked, and whether or not its prefix came from the prefix cache.

Driven by the real scheduler (`deepinfer_sched`) and the paged runner (`deepinfer_model.runtime`), on the
default deepinfer-tiny model; the stateless `model.forward` of the same tokens is the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.default_model import resolve_model
from deepinfer_model import batch_invariant, load_model
from deepinfer_model.numerics import linear
from deepinfer_model.runtime import PagedRunner
from deepinfer_sched import Scheduler, SchedulerConfig

BLOCK = 16


@pytest.fixture(autouse=True)
def _invariant_mode(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_model(None)[0], torch.float32)


# ---------------------------------------------------------------------------------- the GEMM switch
def test_tiled_matmul_row_does_not_depend_on_batch_size_or_neighbours():
    g = torch.Generator().manual_seed(0)
    w_t = torch.randn(384, 300, generator=g, dtype=torch.float64).float().double()
    rows = torch.randn(40, 384, generator=g).float().double()
    alone = batch_invariant.tiled_matmul(rows[:1], w_t)[0]
    for m in (2, 7, 8, 9, 16, 33, 40):
        for perm_seed in range(3):
            perm = torch.randperm(m, generator=torch.Generator().manual_seed(perm_seed))
            batch = rows[:m][perm]
            out = batch_invariant.tiled_matmul(batch, w_t)
            assert torch.equal(out[int((perm == 0).nonzero())], alone), (m, perm_seed)
    # and it is the matrix product: against a float64 sum computed one dot product at a time
    exact = torch.tensor(
        [float(np.dot(rows[0].numpy(), w_t[:, j].numpy())) for j in range(w_t.shape[1])], dtype=torch.float64
    )
    torch.testing.assert_close(alone, exact, rtol=1e-13, atol=1e-13)


def test_default_mode_gemm_rows_do_change_with_batch_size(monkeypatch):
    """Why the mode exists: MKL's FP64 GEMM gives a row other last bits for other row counts."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    g = torch.Generator().manual_seed(1)
    w_t = torch.randn(1024, 512, generator=g, dtype=torch.float64)
    x = torch.randn(64, 1024, generator=g, dtype=torch.float64)
    full = batch_invariant.matmul(x, w_t)
    differing = sum(not torch.equal(batch_invariant.matmul(x[:m], w_t), full[:m]) for m in range(1, 65))
    assert differing > 0
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    full = batch_invariant.matmul(x, w_t)
    assert all(torch.equal(batch_invariant.matmul(x[:m], w_t), full[:m]) for m in range(1, 65))


def test_linear_rows_are_batch_invariant_in_the_mode():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 512, generator=g)
    x = torch.randn(21, 512, generator=g)
    full = linear(x, w)
    for m in (1, 5, 8, 13):
        assert torch.equal(linear(x[:m], w), full[:m])
    assert torch.equal(linear(x[3], w), full[3])  # a 1-D row too


# ------------------------------------------------------------------------- through the real scheduler
def _run(model, prompts, max_tokens, budget, prefix_first=None):
    """Greedy generation of `prompts` (the target is prompts[0]) with the scheduler deciding batching
    and chunking under a token `budget`. Returns the target's logits rows, the target's query lengths
    per step, how many sequences shared its steps, and the scheduler's stats."""
    cfg = SchedulerConfig(
        num_blocks=96, block_size=BLOCK, max_num_batched_tokens=budget, max_model_len=256, max_num_seqs=8
    )
    sched = Scheduler(cfg)
    runner = PagedRunner(model, num_blocks=96, block_size=BLOCK)
    if prefix_first is not None:  # run it to completion first: its full blocks stay in the prefix cache
        _drive(sched, runner, {sched.add_request(prefix_first, max_tokens=1, ignore_eos=True): None})
    ids = {sched.add_request(p, max_tokens=max_tokens, ignore_eos=True): i for i, p in enumerate(prompts)}
    return _drive(sched, runner, ids), sched.stats()


def _drive(sched, runner, ids):
    target_rows, target_chunks, neighbours = [], [], []
    while sched.has_unfinished():
        out = sched.schedule()
        logits = runner.execute(out)
        emits = np.asarray(out.emits_tokens)
        seq_ids = np.asarray(out.seq_ids).tolist()
        tokens, row = [], 0
        for i, sid in enumerate(seq_ids):
            if ids.get(sid) == 0:
                target_chunks.append(int(np.asarray(out.query_lens)[i]))
                neighbours.append(len(seq_ids) - 1)
            if not emits[i]:
                tokens.append(0)
                continue
            if ids.get(sid) == 0:
                target_rows.append(logits[row].clone())
            tokens.append(int(torch.argmax(logits[row])))
            row += 1
        sched.update_from_output(out, np.array(tokens, dtype=np.int32))
    return target_rows, target_chunks, neighbours


def test_logits_identical_across_batch_chunking_and_prefix_cache(model):
    rng = np.random.default_rng(7)
    prefix = rng.integers(1000, 90_000, 2 * BLOCK).tolist()
    target = prefix + rng.integers(1000, 90_000, 5).tolist()
    others = [rng.integers(1000, 90_000, int(n)).tolist() for n in (3, 29, 11, 50)]
    tokens = 4

    (alone, chunks_alone, _), _ = _run(model, [target], tokens, budget=256)
    (mixed, chunks_mixed, neigh), _ = _run(model, [target, *others], tokens, budget=24)
    (cached, chunks_cached, neigh_c), stats = _run(
        model, [target, *others[1:3]], tokens, budget=40, prefix_first=prefix + [5, 6, 7]
    )

    # the scenarios really differ: one chunk alone / several chunks among others / a prefix-cache hit
    assert chunks_alone[0] == len(target) and max(chunks_mixed) < len(target)
    assert max(neigh) > 0 and max(neigh_c) > 0
    assert stats["prefix_cache_hit_tokens"] >= len(prefix) and chunks_cached[0] == len(target) - len(prefix)
    assert len(alone) == len(mixed) == len(cached) == tokens
    for step, (a, b, c) in enumerate(zip(alone, mixed, cached)):
        assert torch.equal(a, b), f"step {step}: batching / chunking changed the logits"
        assert torch.equal(a, c), f"step {step}: the prefix-cache hit changed the logits"
    # and the rows are the model's: the stateless forward over the whole sequence, last row
    seq = target + [int(torch.argmax(r)) for r in alone]
    ref = model.forward(torch.tensor(seq[:-1])).logits[-tokens:].float()
    assert torch.equal(torch.stack(alone), ref)


def test_logits_do_not_depend_on_the_thread_count(model):
    """The mode fixes shapes, not threads: MKL splits a fixed-shape GEMM over threads along the output,
    never along K, so 1 and 2 intra-op threads give the same bits (no thread pinning needed)."""
    seq = torch.arange(1000, 1030)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = model.forward(seq).logits
        torch.set_num_threads(2)
        two = model.forward(seq).logits
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_settings_are_read_once_per_step_and_at_every_call_outside(monkeypatch):
    """`numerics.resolved()` (entered by the paged runner once per step) serves the settings read at its
    start; outside it they follow the environment at every call (tests and benchmarks flip them)."""
    from deepinfer_model import numerics

    with numerics.resolved():
        monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
        monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
        assert batch_invariant.enabled() and numerics.mode() == "exact"
        assert numerics.carrier() == torch.float64
        with numerics.resolved():  # a nested step re-reads them, then restores the outer values
            assert not batch_invariant.enabled() and numerics.carrier() == torch.float32
        assert batch_invariant.enabled() and numerics.carrier() == torch.float64
    assert not batch_invariant.enabled() and numerics.mode() == "native"
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="cannot be combined"):  # validated when the step starts
        with numerics.resolved():
            pass
    assert batch_invariant.switch._PINNED.value is None and numerics._PINNED.value is None
