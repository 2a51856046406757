"""Bad input raises ValueError naming the field."""

import pytest
import torch
from deepinfer_spec import (
    ConfidenceScheduler,
    DraftVerifier,
    SpecDecodeState,
    SpecStats,
    StepTimeCurve,
    VarlenRequest,
    expected_calibration_error,
    nextn_from_env,
    varlen_from_env,
)


@pytest.mark.parametrize("make", [SpecDecodeState, SpecStats, ConfidenceScheduler])
def test_negative_nextn(make):
    with pytest.raises(ValueError, match="nextn"):
        make(-1)


def test_state_rejects_bad_proposals():
    state = SpecDecodeState(3)
    state.add(0)
    with pytest.raises(ValueError, match="confidences"):
        state.propose(0, [1, 2], [0.5, 1.5])
    with pytest.raises(ValueError, match="confidences"):
        state.propose(0, [1, 2], [0.5])
    with pytest.raises(ValueError, match="drafts"):
        state.propose(0, [1, 2, 3, 4], [0.5] * 4)
    with pytest.raises(ValueError, match="draft_probs"):
        state.propose(0, [1, 2], [0.5, 0.5], torch.ones(3, 4))
    with pytest.raises(ValueError, match="seq_id"):
        state.propose(7, [1], [0.5])
    with pytest.raises(ValueError, match="seq_id"):
        state.add(0)


def test_verifier_rejects_bad_inputs():
    v = DraftVerifier()
    probs = torch.full((3, 4), 0.25)
    ok = dict(seeds=[0], base_positions=[0], greedy=[False], draft_probs=torch.full((2, 4), 0.25))
    with pytest.raises(ValueError, match="target_probs"):
        v.verify(probs[:2], [1, 2], [2], **ok)
    with pytest.raises(ValueError, match="draft_tokens"):
        v.verify(probs, [1], [2], **ok)
    with pytest.raises(ValueError, match="draft_tokens"):
        v.verify(probs, [1, 4], [2], **ok)
    with pytest.raises(ValueError, match="seeds"):
        v.verify(probs, [1, 2], [2], **{**ok, "seeds": [0, 1]})
    with pytest.raises(ValueError, match="num_drafts"):
        v.verify(probs[:1], [], [-1], **{**ok, "draft_probs": None})
    with pytest.raises(ValueError, match="draft_probs"):
        v.verify(probs, [1, 2], [2], **{**ok, "draft_probs": None})
    with pytest.raises(ValueError, match="draft_probs"):
        v.verify(probs, [1, 2], [2], **{**ok, "draft_probs": torch.ones(2, 5)})
    with pytest.raises(ValueError, match="target_probs"):
        v.verify(-probs, [1, 2], [2], **ok)
    with pytest.raises(ValueError, match="draft_prob_penalty"):
        DraftVerifier(draft_prob_penalty=-1)


def test_scheduler_rejects_bad_requests():
    sched = ConfidenceScheduler(3, StepTimeCurve([8], [1.0]))
    with pytest.raises(ValueError, match="accept_rates"):
        sched.choose([VarlenRequest(3, [0.5, 1.2, 0.1])])
    with pytest.raises(ValueError, match="accept_rates"):
        sched.choose([VarlenRequest(3, [0.5, 0.6, 0.1])])  # not cumulative
    with pytest.raises(ValueError, match="accept_rates"):
        sched.choose([VarlenRequest(3, [0.5])])
    with pytest.raises(ValueError, match="num_drafts"):
        sched.choose([VarlenRequest(4)])
    with pytest.raises(ValueError, match="schedule_cnt"):
        sched.choose([VarlenRequest(0, schedule_cnt=3, process_cnt=1)])
    with pytest.raises(ValueError, match="curve"):
        ConfidenceScheduler(3, None, enabled=True)


def test_curve_and_stats_and_env_reject_bad_values(tmp_path):
    with pytest.raises(ValueError, match="strictly increasing"):
        StepTimeCurve([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError, match="forward_ms"):
        StepTimeCurve([4], [0.0])
    with pytest.raises(ValueError, match="mode"):
        StepTimeCurve([4], [1.0], mode="cubic")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        StepTimeCurve.load(tmp_path / "bad.json")
    stats = SpecStats(2)
    with pytest.raises(ValueError, match="num_accepted"):
        stats.record_step([1], [2])
    with pytest.raises(ValueError, match="num_verified"):
        stats.record_step([3], [0])
    with pytest.raises(ValueError, match="confidences"):
        stats.record_step([1], [0], [0.5, 0.5], [1.0, 1.0])
    with pytest.raises(ValueError, match="confidences"):
        expected_calibration_error([1.5], [1.0])
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE"):
        nextn_from_env({"DEEPINFER_USE_NEXTN_DECODE": "-1"})
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE"):
        nextn_from_env({"DEEPINFER_USE_NEXTN_DECODE": "five"})
    with pytest.raises(ValueError, match="DEEPINFER_ENABLE_MTP_VARLEN"):
        varlen_from_env({"DEEPINFER_ENABLE_MTP_VARLEN": "maybe"})
    assert nextn_from_env({}) == 5 and nextn_from_env({"DEEPINFER_USE_NEXTN_DECODE": "0"}) == 0
    assert varlen_from_env({}) is True and varlen_from_env({"DEEPINFER_ENABLE_MTP_VARLEN": "0"}) is False
