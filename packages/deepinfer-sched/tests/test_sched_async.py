"""Scheduling one step ahead of the unprocessed one, and reconciling it when the outputs arrive."""

import numpy as np
import pytest
from deepinfer_sched import Scheduler, SchedulerConfig
from deepinfer_sched.testing import Driver, FakeModel, RequestSpec, expected_stream

V = 23


def make(**kw):
    base = dict(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48)
    base.update(kw)
    cfg = SchedulerConfig(**base)
    return Scheduler(cfg), FakeModel(cfg.num_blocks, cfg.block_size, V)


def test_schedule_ahead_assumes_outputs_and_reconcile_makes_them_exact():
    sched, model = make(num_speculative_tokens=2)
    a = sched.add_request([1, 2, 3], max_tokens=2)  # finishes after two tokens
    b = sched.add_request([4, 5, 6, 7, 8], max_tokens=10)
    first = sched.schedule()
    ahead = sched.schedule()  # before `first` is processed
    assert ahead.has_unknown_input_ids and ahead.prev_rows.tolist() == [0, 1]
    # Each sequence decodes its (unknown) first token plus 2 assumed drafts.
    assert ahead.query_lens.tolist() == [1, 3]  # a: its 2nd token is its last, no draft fits
    assert ahead.input_ids.tolist() == [-1] * 4 and ahead.positions.tolist() == [3, 5, 6, 7]
    with pytest.raises(RuntimeError, match="two steps are already unprocessed"):
        sched.schedule()
    with pytest.raises(ValueError, match="in the order schedule"):
        sched.update_from_output(ahead, [[1], [1]])
    with pytest.raises(ValueError, match="only the single unprocessed step"):
        sched.reconcile(ahead)
    sched.update_from_output(first, model.run(sched, first))
    sched.set_draft_tokens(b, [9])  # the drafter proposed only one draft for b
    exact = sched.reconcile(ahead)
    assert not exact.has_unknown_input_ids and exact.step_id == ahead.step_id
    assert exact.query_lens.tolist() == [1, 2]  # a: no drafts proposed; b: one draft
    assert exact.input_ids.tolist()[0] == sched.token_ids(a)[-1]
    assert exact.input_ids.tolist()[1:] == [sched.token_ids(b)[-1], 9]
    assert exact.positions.tolist() == [3, 5, 6]
    with pytest.raises(ValueError, match="replaced by reconcile"):
        sched.update_from_output(ahead, [[1], [1]])
    sched.update_from_output(exact, model.run(sched, exact))
    sched.check_invariants()


def test_sequences_finished_meanwhile_are_dropped_and_their_blocks_freed():
    sched, model = make()
    a = sched.add_request([1, 2, 3], max_tokens=1)  # its prefill produces its only token
    b = sched.add_request([4, 5, 6], max_tokens=5)
    first = sched.schedule()
    ahead = sched.schedule()
    assert ahead.seq_ids.tolist() == [b]  # a may finish in `first`: not scheduled again
    fin = sched.update_from_output(first, model.run(sched, first))
    assert fin == [(a, "length")] and sched.block_table(a).size == 0
    c = sched.add_request([7, 8], max_tokens=5)
    sched.abort(b)
    exact = sched.reconcile(ahead)
    assert exact.num_seqs == 0  # b was aborted while its step was scheduled ahead
    sched.update_from_output(exact, np.zeros(0, dtype=np.int32))
    Driver(sched, model, asynchronous=True).drain(50)
    assert sched.finish_reason(c) == "length"
    assert sched.stats()["num_free_blocks"] == 32


@pytest.mark.parametrize("num_drafts", [0, 2])
def test_async_loop_gives_the_same_tokens_as_the_sync_loop(num_drafts):
    streams = {}
    for asynchronous in (False, True):
        sched, model = make(num_blocks=14, num_speculative_tokens=num_drafts)
        specs = [
            RequestSpec(i, [(i * 5 + j) % V for j in range(3 + 2 * i)], 8 + i, eos_token_id=0)
            for i in range(10)
        ]
        for spec in specs:
            sched.add_request(spec.prompt, seq_id=spec.seq_id, max_tokens=spec.max_tokens, eos_token_id=0)
        drv = Driver(
            sched,
            model,
            asynchronous=asynchronous,
            num_drafts=num_drafts,
            on_update=lambda out, s=sched: s.check_invariants(),
        )
        drv.drain(400)
        assert sched.stats()["num_preemptions"] > 0
        streams[asynchronous] = {s.seq_id: sched.output_token_ids(s.seq_id).tolist() for s in specs}
        for spec in specs:
            assert streams[asynchronous][spec.seq_id] == expected_stream(spec, 48, V)[0]
    assert streams[False] == streams[True]


def test_device_side_fill_without_reconcile_gives_the_same_tokens():
    """Without drafts, a step scheduled ahead is exact except for the tokens sampled by the step
    before it; a device fills them in through prev_rows, and update_from_output drops the rows of
    sequences that finished meanwhile."""
    sched, model = make(num_blocks=14)
    specs = [
        RequestSpec(i, [(i * 3 + j) % V for j in range(2 + 3 * i)], 6 + 2 * i, eos_token_id=0)
        for i in range(8)
    ]
    for spec in specs:
        sched.add_request(spec.prompt, seq_id=spec.seq_id, max_tokens=spec.max_tokens, eos_token_id=0)
    pending, pending_ids = sched.schedule(), None
    for _ in range(300):
        if not sched.has_unfinished():
            break
        ahead = sched.schedule()
        sampled = model.run(sched, pending, pending_ids)
        sched.update_from_output(pending, sampled)
        sched.check_invariants()
        ids = ahead.input_ids.copy()
        for row, prev in enumerate(ahead.prev_rows.tolist()):
            start = ahead.query_start_loc[row]
            if prev >= 0 and ids[start] < 0:
                ids[start] = sampled[prev][-1]
        pending, pending_ids = ahead, ids
    assert not sched.has_unfinished()
    for spec in specs:
        assert sched.output_token_ids(spec.seq_id).tolist() == expected_stream(spec, 48, V)[0]
    assert sched.stats()["num_preemptions"] > 0


def test_empty_steps_need_no_update():
    sched, model = make()
    empty = sched.schedule()
    assert empty.is_empty and sched.num_inflight_steps == 0
    assert sched.update_from_output(empty, np.zeros(0, dtype=np.int32)) == []  # allowed, a no-op
    assert sched.reconcile(empty) is empty
    sid = sched.add_request([1, 2], max_tokens=1)
    out = sched.schedule()
    assert sched.num_inflight_steps == 1
    assert sched.update_from_output(out, model.run(sched, out)) == [(sid, "length")]
    assert sched.num_inflight_steps == 0


@pytest.mark.parametrize("asynchronous", [False, True])
def test_finish_preempted_ends_the_victims_with_what_they_have(asynchronous):
    """finish_preempted: a victim finishes at once (reason "preempted") with a prefix of its stream,
    its blocks freed and its results of a step still in flight dropped; the others are untouched."""
    for finish in (False, True):
        sched, model = make(num_blocks=14, finish_preempted=finish)
        specs = [RequestSpec(i, [(i * 5 + j) % V for j in range(3 + 2 * i)], 8 + i) for i in range(10)]
        for spec in specs:
            sched.add_request(spec.prompt, seq_id=spec.seq_id, max_tokens=spec.max_tokens)
        victims: list[int] = []
        drv = Driver(
            sched,
            model,
            asynchronous=asynchronous,
            on_schedule=lambda out, _, v=victims: v.extend(out.preempted_seq_ids.tolist()),
            on_update=lambda out, s=sched: s.check_invariants(),
        )
        drv.drain(400)
        assert victims and sched.stats()["num_preemptions"] == len(victims)
        assert sorted(drv.finished) == [s.seq_id for s in specs]  # every finish is reported once
        for spec in specs:
            full, reason = expected_stream(spec, 48, V)
            got = sched.output_token_ids(spec.seq_id).tolist()
            if finish and spec.seq_id in victims:
                assert drv.finished[spec.seq_id] == "preempted"
                assert sched.finish_reason(spec.seq_id) == "preempted"
                assert len(got) < len(full) and got == full[: len(got)]
                assert sched.num_preemptions(spec.seq_id) == 1  # preempted once: it never ran again
            else:
                assert (got, drv.finished[spec.seq_id]) == (full, reason)
        assert sched.stats()["num_free_blocks"] == 14
