"""Long prefill chunks attend in query blocks (bounded score memory): the logits must not change."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint, paged
from deepinfer_model.runner import RunnerBatch
from deepinfer_model.runtime import PagedRunner, groups


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41"), seed=3))


def _prefill_logits(model, ids: np.ndarray) -> torch.Tensor:
    runner = PagedRunner(model, num_blocks=16, block_size=8)
    n = len(ids)
    batch = RunnerBatch(
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
    monkeypatch.setattr(groups, "SCORE_BLOCK_ELEMENTS", elements)  # 1: one query slot per block
    blocked = _prefill_logits(model, ids)
    assert torch.isfinite(blocked).all()
    assert torch.equal(whole, blocked)


@pytest.mark.parametrize("elements", [1, 3000, 9000])
def test_row_blocked_query_side_gives_the_same_logits(model, monkeypatch, elements):
    """A long step runs queries, index scores, attention and output projection per block of rows (1: one
    row per block; the others cut both sequences and the boundary between them)."""
    ids = np.random.default_rng(1).integers(4, model.config.vocab_size, 44)
    whole = _prefill_logits(model, ids)
    monkeypatch.setattr(groups, "QUERY_BLOCK_ELEMENTS", elements)
    step = SimpleNamespace(num_seqs=2, ends=np.array([44, 39]))
    assert paged.query_block_rows(model, step) < 39  # more than one block per sequence
    blocked = _prefill_logits(model, ids)
    assert torch.isfinite(blocked).all()
    assert torch.equal(whole, blocked)


def _one_sequence_logits(model, ids: np.ndarray) -> torch.Tensor:
    runner = PagedRunner(model, num_blocks=8, block_size=8)
    n = len(ids)
    batch = RunnerBatch(
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
        monkeypatch.setattr(groups, "QUERY_BLOCK_ELEMENTS", elements)
    ids = np.random.default_rng(2).integers(4, model.config.vocab_size, 44)
    seen = []
    make = groups.make_groups
    monkeypatch.setattr(groups, "make_groups", lambda m: seen.extend(make(m)) or make(m))
    direct = _one_sequence_logits(model, ids)
    assert seen and all(g.covers_step for g in seen)
    monkeypatch.setattr(groups, "_covers_step", lambda packed, n: False)
    seen.clear()
    scattered = _one_sequence_logits(model, ids)
    assert seen and not any(g.covers_step for g in seen)
    assert torch.isfinite(direct).all()
    assert torch.equal(direct, scattered)


def test_covers_step_only_for_the_steps_rows_in_order():
    assert groups._covers_step(np.arange(5), 5)
    assert not groups._covers_step(np.arange(4), 5)  # padding slots or another group hold a row
    assert not groups._covers_step(np.array([1, 0, 2]), 3)  # sequences out of row order
