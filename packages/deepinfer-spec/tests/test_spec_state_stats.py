"""Draft bookkeeping across a step and the accounting formulas against hand-computed values."""

import pytest
import torch
from deepinfer_spec import (
    ConfidenceScheduler,
    DraftVerifier,
    SpecDecodeState,
    SpecStats,
    expected_calibration_error,
    full_acceptance_tokens_per_s,
)


def test_state_one_step_lifecycle():
    state = SpecDecodeState(nextn=3)
    state.add("a", seed=1)
    state.add("b", seed=2)
    # Right after prefill there are no drafts: the first decode step verifies nothing.
    plan = ConfidenceScheduler(3).choose(state.varlen_inputs(["a", "b"]))
    assert plan.num_verify == [0, 0]

    state.propose("a", [4, 5, 6], [0.9, 0.5, 0.5])
    state.propose("b", [1, 2, 3], [0.2, 1.0, 1.0], stop_emitted=True)  # stop emitted: confidences 0
    inputs = state.varlen_inputs(["a", "b"])
    assert inputs[0].accept_rates == pytest.approx([0.9, 0.45, 0.225])
    assert inputs[1].accept_rates == [0.0, 0.0, 0.0]
    assert inputs[0].has_draft_info and inputs[0].schedule_cnt == inputs[0].process_cnt == 0

    plan = ConfidenceScheduler(3).choose(inputs)
    state.mark_scheduled(["a", "b"])
    tokens, probs, confs = state.pack(["a", "b"], plan)
    assert tokens.tolist() == [4, 5, 6, 1, 2, 3] and probs is None
    assert confs == pytest.approx([0.9, 0.5, 0.5, 0.0, 0.0, 0.0])

    # Target argmax per row: request a accepts 4 then rejects 5 (target says 7); b accepts all three.
    argmax = [4, 7, 0, 0, 1, 2, 3, 8]
    rows = torch.nn.functional.one_hot(torch.tensor(argmax), 10).double()
    result = DraftVerifier().verify(
        rows, tokens, plan.num_verify, seeds=[1, 2], base_positions=[9, 9], greedy=[True, True]
    )
    rollbacks = state.commit(["a", "b"], result)
    a, b = rollbacks
    assert (a.num_verified, a.num_accepted, a.emitted, a.discarded_tokens) == (3, 1, [4, 7], [5, 6])
    assert (a.num_rows_written, a.num_rows_kept, a.num_discarded) == (4, 2, 2)
    assert (b.num_accepted, b.emitted, b.discarded_tokens, b.num_discarded) == (3, [1, 2, 3, 8], [], 0)
    assert state.pending("a") == ([], [])
    nxt = state.varlen_inputs(["a"])[0]
    assert nxt.schedule_cnt == nxt.process_cnt == 1 and nxt.num_drafts == 0

    # The next proposal keeps the previous round's rates for the budget rule.
    state.propose("a", [1, 1, 1], [0.5, 0.5, 0.5])
    nxt = state.varlen_inputs(["a"])[0]
    assert nxt.prev_accept_rates == pytest.approx([0.9, 0.45, 0.225])
    assert nxt.accept_rates == pytest.approx([0.5, 0.25, 0.125])
    assert state.draft_seed("a") == 1 + 1_000_000_007

    # Preempted: drafts and history are dropped; the seed stays.
    state.mark_scheduled(["a"])
    state.discard("a")
    fresh = state.varlen_inputs(["a"])[0]
    assert (fresh.num_drafts, fresh.has_draft_info, fresh.schedule_cnt, fresh.prev_accept_rates) == (
        0,
        False,
        0,
        [],
    )
    assert state.draft_seed("a") == 1 + 1_000_000_007


def test_stats_against_hand_computed_values():
    stats = SpecStats(nextn=3)
    stats.record_step([3, 2], [1, 2], [0.9, 0.5, 0.2, 0.8, 0.6], [1.0, 0.0, 0.5, 1.0, 1.0], seconds=0.5)
    stats.record_step([3], [0], [0.1, 0.1, 0.1], [0.0, 0.0, 0.3], seconds=0.5)
    assert stats.verified.tolist() == [3, 3, 2]
    assert stats.accepted.tolist() == [2, 1, 0]
    assert stats.acceptance_rate_per_position() == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert stats.avg_accept_rate() == pytest.approx(3 / 8)
    assert stats.avg_accepted_len() == pytest.approx(1.0)
    assert stats.avg_verified_len() == pytest.approx(8 / 3)
    assert stats.tokens_per_request_step() == pytest.approx(2.0)
    assert stats.avg_confidence_error() == pytest.approx(1.9 / 8)
    # Bins of width 0.1: singletons 0.9, 0.5, 0.2, 0.8, 0.6 (errors .1 .5 .3 .2 .4); bin [0.1, 0.2)
    # holds three rows with mean confidence 0.1 and mean accept prob 0.1 (error 0).
    assert stats.calibration_error(10) == pytest.approx(1.5 / 8)
    tp = stats.throughput()
    assert tp["steps_per_s"] == pytest.approx(2.0)
    assert tp["full_acceptance_tok_per_s"] == pytest.approx(2.0 * 1.5 * 4)
    assert tp["accepted_tok_per_s"] == pytest.approx(6.0)
    assert stats.summary()["tokens_per_request_step"] == pytest.approx(2.0)


def test_full_acceptance_formula_and_ece_edges():
    assert full_acceptance_tokens_per_s(10.0, 32, 5, cp=2) == pytest.approx(10 * 32 * 6 / 2)
    assert full_acceptance_tokens_per_s(10.0, 32, 0) == pytest.approx(320)
    assert expected_calibration_error([1.0, 1.0], [1.0, 0.0], num_bins=4) == pytest.approx(0.5)
    assert expected_calibration_error([0.25, 0.75], [0.25, 0.75], num_bins=2) == 0.0
    assert expected_calibration_error([], []) == 0.0


def test_reliability_bins_hand_computed_and_consistent_with_ece():
    stats = SpecStats(nextn=3)
    assert stats.reliability_bins() == [] and stats.summary()["confidence_reliability"] == []
    stats.record_step([3, 2], [1, 2], [0.95, 0.5, 0.12, 0.18, 1.0], [1.0, 0.0, 0.5, 0.0, 1.0])
    bins = stats.reliability_bins(5)  # edges 0, .2, .4, .6, .8, 1; 1.0 joins the last bin
    assert [(b["low"], b["high"], b["count"]) for b in bins] == [(0.0, 0.2, 2), (0.4, 0.6, 1), (0.8, 1.0, 2)]
    assert [b["mean_confidence"] for b in bins] == pytest.approx([0.15, 0.5, 0.975])
    assert [b["mean_accept_prob"] for b in bins] == pytest.approx([0.25, 0.0, 1.0])
    ece = sum(b["count"] / 5 * abs(b["mean_confidence"] - b["mean_accept_prob"]) for b in bins)
    assert ece == pytest.approx(stats.calibration_error(5))
    assert stats.summary()["confidence_reliability"] == stats.reliability_bins(10)
    with pytest.raises(ValueError, match="num_bins"):
        stats.reliability_bins(0)
