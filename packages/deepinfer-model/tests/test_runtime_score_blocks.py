"""Long prefill chunks attend in query blocks (bounded score memory): the logits must not change."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepinfer_model.models import grouped_attention as groups
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint, paged
from deepinfer_model.models.grouped_attention import groups as grouping
from deepinfer_model.models.grouped_attention import sizes
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41"), seed=3))


def _prefill_logits(model, ids: np.ndarray) -> torch.Tensor:
    runner = PagedRunner(model, num_blocks=16, block_size=8)
    n = len(ids)
    batch = StepBatch.of(
        seq_ids=np.array([0, 1], dtype=np.int64),
        start_positions=np.zeros(2, dtype=np.int64),
        query_lens=np.array([n, n - 5], dtype=np.int64),
        block_tables=[np.arange(8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)],
        input_ids=np.concatenate((ids, ids[:-5][::-1])).astype(np.int64),
        logits_lens=np.array([n, n - 5], dtype=np.int64),
    )
    return runner.execute(batch)


@pytest.mark.parametrize("elements", [1, 700, 5000])
def test_query_blocked_attention_gives_the_same_logits(model, monkeypatch, elements):
    ids = np.random.default_rng(0).integers(4, model.config.vocab_size, 44)
    whole = _prefill_logits(model, ids)
    monkeypatch.setattr(sizes, "SCORE_BLOCK_ELEMENTS", elements)  # 1: one query slot per block
    blocked = _prefill_logits(model, ids)
    assert torch.isfinite(blocked).all()
    assert torch.equal(whole, blocked)


@pytest.mark.parametrize("elements", [1, 3000, 9000])
def test_row_blocked_query_side_gives_the_same_logits(model, monkeypatch, elements):
    """A long step runs queries, index scores, attention and output projection per block of rows (1: one
    row per block; the others cut both sequences and the boundary between them)."""
    ids = np.random.default_rng(1).integers(4, model.config.vocab_size, 44)
    whole = _prefill_logits(model, ids)
    monkeypatch.setattr(sizes, "QUERY_BLOCK_ELEMENTS", elements)
    step = SimpleNamespace(num_seqs=2, ends=np.array([44, 39]))
    assert paged.query_block_rows(model, step) < 39  # more than one block per sequence
    blocked = _prefill_logits(model, ids)
    assert torch.isfinite(blocked).all()
    assert torch.equal(whole, blocked)


def _one_sequence_logits(model, ids: np.ndarray) -> torch.Tensor:
    runner = PagedRunner(model, num_blocks=8, block_size=8)
    n = len(ids)
    batch = StepBatch.of(
        seq_ids=np.array([0], dtype=np.int64),
        start_positions=np.zeros(1, dtype=np.int64),
        query_lens=np.array([n], dtype=np.int64),
        block_tables=[np.arange(8, dtype=np.int32)],
        input_ids=ids.astype(np.int64),
        logits_lens=np.array([n], dtype=np.int64),
    )
    return runner.execute(batch)


@pytest.mark.parametrize("elements", [None, 3000])
def test_one_sequence_output_without_scatter_is_the_scattered_one(model, monkeypatch, elements):
    """A one-sequence chunk (whole, or each of its row blocks) is one group whose rows are the step's in
    order (`covers_step`): its attention output is used as it is. Scattering it into a step-sized buffer
    instead (the general path) must give the same logits."""
    if elements is not None:
        monkeypatch.setattr(sizes, "QUERY_BLOCK_ELEMENTS", elements)
    ids = np.random.default_rng(2).integers(4, model.config.vocab_size, 44)
    seen = []
    make = grouping.make_groups
    monkeypatch.setattr(grouping, "make_groups", lambda m: seen.extend(make(m)) or make(m))
    direct = _one_sequence_logits(model, ids)
    assert seen and all(g.covers_step for g in seen)
    monkeypatch.setattr(grouping, "_covers_step", lambda packed, n: False)
    seen.clear()
    scattered = _one_sequence_logits(model, ids)
    assert seen and not any(g.covers_step for g in seen)
    assert torch.isfinite(direct).all()
    assert torch.equal(direct, scattered)


def test_covers_step_only_for_the_steps_rows_in_order():
    assert grouping._covers_step(np.arange(5), 5)
    assert not grouping._covers_step(np.arange(4), 5)  # padding slots or another group hold a row
    assert not grouping._covers_step(np.array([1, 0, 2]), 3)  # sequences out of row order


def test_listed_attention_takes_a_whole_steps_queries_as_they_are():
    """`listed_attention` (FlashMLA's form) gathers the group's query slots from the step's q; a one-sequence
    chunk's group (its slots are the step's rows, no padding) passes q as it is: the same result as the
    gathered rows, for the reference kernel."""
    import dataclasses

    from deepinfer_model.backends import cpu as reference
    from deepinfer_model.runtime.metadata import StepMetadata
    from deepinfer_model.runtime.pools import PagedKVCache, PoolSpec

    block, nh, d, n = 8, 4, 32, 37
    batch = StepBatch.of(
        seq_ids=np.zeros(1, dtype=np.int64),
        start_positions=np.array([5]),
        query_lens=np.array([n]),
        block_tables=[np.arange(6, dtype=np.int32)],
        input_ids=np.zeros(n, dtype=np.int64),
        logits_lens=np.ones(1, dtype=np.int64),
    )
    meta = StepMetadata.build(batch, block, num_blocks=6)
    (g,) = groups.make_groups(meta)
    assert g.covers_step and g.real_slots is None
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache([PoolSpec("swa.0", block, d)], 6)
    cache.write("swa.0", torch.arange(48), torch.randn(48, d, generator=gen).bfloat16().float())
    q = torch.randn(n, nh, d, generator=gen).bfloat16()
    sinks = torch.randn(nh, generator=gen)
    wk = groups.swa_keys(cache, meta, g, "swa.0", 16)
    op = reference.sparse_prefill_attention
    direct = groups.listed_attention(op, q, wk, g, sinks, d**-0.5, meta)
    gathered = groups.listed_attention(
        op, q, wk, dataclasses.replace(g, covers_step=False), sinks, d**-0.5, meta
    )
    assert direct.shape == (n, nh, d) and torch.isfinite(direct.float()).all()
    assert torch.equal(direct, gathered)
