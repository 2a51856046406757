"""Scheduling rules: budgets, chunked prefill, FIFO / priority admission, drafts, preemption,
stop conditions, abort, engine types and the shape of SchedulerOutput."""

import numpy as np
import pytest
from deepinfer_sched import Scheduler as S
from deepinfer_sched import SchedulerConfig, SequenceStatus
from deepinfer_sched.testing import Driver, FakeModel, RequestSpec, expected_stream

V = 23


def make(**kw):
    base = dict(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48)
    base.update(kw)
    cfg = SchedulerConfig(**base)
    return S(cfg), FakeModel(cfg.num_blocks, cfg.block_size, V)


def add(sched, spec: RequestSpec):
    return sched.add_request(
        spec.prompt,
        seq_id=spec.seq_id,
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        stop_token_ids=spec.stop_token_ids,
        eos_token_id=spec.eos_token_id,
        ignore_eos=spec.ignore_eos,
        priority=spec.priority,
    )


def step(sched, model):
    out = sched.schedule()
    fin = sched.update_from_output(out, model.run(sched, out))
    sched.check_invariants()
    return out, fin


def test_output_arrays_are_flat_typed_readonly_views():
    sched, model = make()
    a = sched.add_request([1, 2, 3, 4, 5, 6], max_tokens=4)
    b = sched.add_request([7, 8, 9], max_tokens=4)
    out = sched.schedule()
    assert out.seq_ids.dtype == np.int64 and out.seq_ids.tolist() == [a, b]
    assert out.query_start_loc.dtype == np.int32 and out.query_start_loc.tolist() == [0, 6, 9]
    assert out.seq_lens.tolist() == [6, 3] and out.start_positions.tolist() == [0, 0]
    assert out.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert out.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert out.slot_mapping.dtype == np.int64
    tables = out.block_tables
    assert tables.shape == (2, 2) and tables.dtype == np.int32 and tables[1, 1] == -1
    assert out.num_batched_tokens == 9 and out.any_prefill and out.is_prefill.tolist() == [True, True]
    assert out.emits_tokens.tolist() == [True, True] and out.logits_indices.tolist() == [5, 8]
    with pytest.raises(ValueError):
        out.positions[0] = 3
    positions = out.positions
    sched.update_from_output(out, np.array([10, 11], dtype=np.int32))
    del out
    assert positions.tolist()[:2] == [0, 1]  # the view keeps its storage alive
    out = sched.schedule()
    assert not out.any_prefill and out.query_lens.tolist() == [1, 1]
    assert out.positions.tolist() == [6, 3] and out.input_ids.tolist() == [10, 11]
    assert [tuple(r) for r in sched.scheduled_seqs(out)] == [(a, 6, 1, False, 0), (b, 3, 1, False, 0)]


def test_chunked_prefill_splits_long_prompts_and_shares_steps():
    sched, model = make(max_num_batched_tokens=16)
    a = sched.add_request(list(range(1, 21)), max_tokens=3)  # 20 tokens
    b = sched.add_request([3, 3, 3, 3, 3, 3], max_tokens=3)
    out, _ = step(sched, model)
    assert out.seq_ids.tolist() == [a] and out.query_lens.tolist() == [16]
    assert out.emits_tokens.tolist() == [False] and sched.output_token_ids(a).size == 0
    assert out.logits_indices.size == 0 and out.logits_lens.tolist() == [0]
    out, _ = step(sched, model)
    assert out.seq_ids.tolist() == [a, b] and out.query_lens.tolist() == [4, 6]
    assert out.start_positions.tolist() == [16, 0]
    assert len(sched.output_token_ids(a)) == 1 and len(sched.output_token_ids(b)) == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    sched, model = make(enable_chunked_prefill=False, max_num_batched_tokens=48)
    a = sched.add_request(list(range(30)), max_tokens=3)
    b = sched.add_request(list(range(30)), max_tokens=3)
    out, _ = step(sched, model)
    assert out.seq_ids.tolist() == [a]  # b would not fit whole in the remaining 18 tokens
    out, _ = step(sched, model)
    assert out.seq_ids.tolist() == [a, b] and out.query_lens.tolist() == [1, 30 - 28]  # prefix hit 28


def test_budgets_are_never_exceeded_and_admission_is_fifo():
    sched, model = make(max_num_seqs=2, max_num_batched_tokens=8)
    ids = [sched.add_request([i + 1] * 5, max_tokens=4) for i in range(6)]
    first_seen = []
    while sched.has_unfinished():
        out, _ = step(sched, model)
        assert out.num_seqs <= 2 and out.num_batched_tokens <= 8
        for sid in out.seq_ids.tolist():
            if sid not in first_seen:
                first_seen.append(sid)
    assert first_seen == ids


def test_priority_orders_admission_and_equal_priorities_stay_fifo():
    sched, model = make(max_num_seqs=1)
    low = sched.add_request([1, 2], max_tokens=1, priority=5)
    high1 = sched.add_request([3, 4], max_tokens=1, priority=-1)
    high2 = sched.add_request([5, 6], max_tokens=1, priority=-1)
    order = []
    while sched.has_unfinished():
        out, _ = step(sched, model)
        order += out.seq_ids.tolist()
    assert order == [high1, high2, low]


def test_drafts_are_verified_and_capped_by_limits():
    sched, model = make(num_speculative_tokens=3)
    a = sched.add_request([1, 2, 3], max_tokens=3)
    step(sched, model)
    sched.set_draft_tokens(a, [4, 5, 6])
    out = sched.schedule()
    # One output exists and max_tokens is 3: at most 1 draft can be verified (2 tokens emitted).
    assert out.query_lens.tolist() == [2] and out.num_draft_tokens.tolist() == [1]
    assert out.input_ids.tolist()[1] == 4 and sched.draft_token_ids(a).size == 0  # consumed
    assert out.logits_indices.tolist() == [0, 1]  # every verification row is sampled
    assert out.logits_lens.tolist() == [2]
    fin = sched.update_from_output(out, [[4, 9]])
    assert fin == [(a, "length")] and sched.output_token_ids(a).tolist()[1:] == [4, 9]


def test_speculative_streams_match_the_reference():
    sched, model = make(num_speculative_tokens=3)
    specs = [RequestSpec(i, [i, i + 1, i + 2, 7], max_tokens=12 + i, eos_token_id=0) for i in range(6)]
    for spec in specs:
        add(sched, spec)
    Driver(sched, model, num_drafts=3).drain(200)
    for spec in specs:
        assert (
            sched.output_token_ids(spec.seq_id).tolist(),
            sched.finish_reason(spec.seq_id),
        ) == expected_stream(spec, 48, V)


def test_preemption_evicts_latest_arrival_and_recompute_gives_same_tokens():
    # 12 blocks of 4 tokens; three sequences growing to 40 tokens cannot all fit.
    sched, model = make(num_blocks=12, max_model_len=48, max_num_seqs=3)
    specs = [RequestSpec(i, [i + 1] * 6, max_tokens=30) for i in range(3)]
    for spec in specs:
        add(sched, spec)
    preempted = []
    while sched.has_unfinished():
        out, _ = step(sched, model)
        preempted += out.preempted_seq_ids.tolist()
        for sid in out.preempted_seq_ids.tolist():
            assert sched.status(sid) in (SequenceStatus.PREEMPTED, SequenceStatus.RUNNING)
    assert preempted and preempted[0] == 2  # the latest arrival goes first
    assert sched.num_preemptions(0) == 0  # the earliest is never the victim while others run
    assert sched.stats()["num_preemptions"] == len(preempted)
    for spec in specs:
        assert (
            sched.output_token_ids(spec.seq_id).tolist(),
            sched.finish_reason(spec.seq_id),
        ) == expected_stream(spec, 48, V)


def test_prompt_lens_are_the_original_prompt_lengths_through_preemption_and_recompute():
    # YOCO truncation keys every step of a sequence on its ORIGINAL prompt length: a recompute after
    # preemption prefills prompt + output so far, but prompt_lens must not grow with it.
    sched, model = make(num_blocks=12, max_model_len=48, max_num_seqs=3)
    specs = [RequestSpec(i, [i + 1] * (5 + i), max_tokens=30) for i in range(3)]
    for spec in specs:
        add(sched, spec)
    prompt_len = {spec.seq_id: len(spec.prompt) for spec in specs}
    preempted, recomputed = set(), 0
    while sched.has_unfinished():
        out, _ = step(sched, model)
        lens = out.prompt_lens
        assert lens.dtype == np.int32 and not lens.flags.writeable and len(lens) == len(out.seq_ids)
        for i, sid in enumerate(out.seq_ids.tolist()):
            assert lens[i] == prompt_len[sid], (sid, int(lens[i]))
            if sid in preempted and out.is_prefill[i] and out.seq_lens[i] > prompt_len[sid]:
                recomputed += 1  # a recompute prefill past the prompt (its output so far), same prompt_lens
        preempted |= set(out.preempted_seq_ids.tolist())
    assert preempted and recomputed > 0


def test_preemption_victim_is_lowest_priority_first():
    sched, model = make(num_blocks=12, max_model_len=48, max_num_seqs=3)
    add(sched, RequestSpec(0, [1] * 6, max_tokens=30, priority=3))  # arrives first, lowest priority
    add(sched, RequestSpec(1, [2] * 6, max_tokens=30))
    add(sched, RequestSpec(2, [3] * 6, max_tokens=30))
    victims = []
    while sched.has_unfinished():
        out, _ = step(sched, model)
        victims += out.preempted_seq_ids.tolist()
    assert victims[0] == 0


@pytest.mark.parametrize("seed", range(4))
def test_stop_conditions_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    sched, model = make(max_num_seqs=8, max_num_batched_tokens=32)
    specs = []
    for i in range(16):
        specs.append(
            RequestSpec(
                seq_id=100 * seed + i,
                prompt=rng.integers(0, V, size=int(rng.integers(1, 20))).tolist(),
                max_tokens=int(rng.integers(1, 40)),
                min_tokens=int(rng.integers(0, 3)),
                stop_token_ids=tuple(int(t) for t in rng.integers(0, V, size=int(rng.integers(0, 2)))),
                eos_token_id=int(rng.integers(0, V)),
                ignore_eos=bool(rng.integers(0, 4) == 0),
            )
        )
        specs[-1].min_tokens = min(specs[-1].min_tokens, specs[-1].max_tokens)
        add(sched, specs[-1])
    Driver(sched, model).drain(500)
    reasons = set()
    for spec in specs:
        tokens, reason = expected_stream(spec, 48, V)
        assert sched.output_token_ids(spec.seq_id).tolist() == tokens
        assert sched.finish_reason(spec.seq_id) == reason
        assert sched.status(spec.seq_id) == SequenceStatus.FINISHED
        if reason == "stop":
            assert sched.stop_token_id(spec.seq_id) == tokens[-1]
        reasons.add(reason)
    assert "stop" in reasons and "length" in reasons


def test_max_model_len_finishes_a_sequence():
    sched, model = make(max_model_len=12)
    spec = RequestSpec(1, [1] * 8, max_tokens=100, ignore_eos=True)
    add(sched, spec)
    Driver(sched, model).drain(50)
    assert sched.finish_reason(1) == "max_model_len" and len(sched.token_ids(1)) == 12


def test_abort_at_any_time_frees_blocks_and_others_continue():
    sched, model = make(max_num_seqs=2)
    specs = [RequestSpec(i, [i + 1] * 9, max_tokens=10) for i in range(4)]
    for spec in specs:
        add(sched, spec)
    step(sched, model)
    assert sched.abort(3) and sched.status(3) == SequenceStatus.FINISHED  # waiting
    assert sched.abort(0) and sched.block_table(0).size == 0  # running
    sched.check_invariants()
    Driver(sched, model).drain(100)
    assert sched.finish_reason(0) == "abort" and sched.finish_reason(3) == "abort"
    assert sched.stats()["num_aborted"] == 2
    for spec in specs[1:3]:
        assert sched.output_token_ids(spec.seq_id).tolist() == expected_stream(spec, 48, V)[0]
    assert sched.stats()["num_free_blocks"] == 32


def test_timestamps_and_stats():
    sched, model = make()
    sid = sched.add_request([1, 2, 3], max_tokens=2)
    assert sched.status(sid) == SequenceStatus.WAITING and sched.timestamps(sid)["first_token"] is None
    out, _ = step(sched, model)
    st = sched.stats()
    assert st["num_running"] == 1 and st["num_waiting"] == 0 and 0 < st["kv_usage"] < 1
    assert st["last_step_num_batched_tokens"] == 3 and st["last_step_num_prefill_tokens"] == 3
    step(sched, model)
    ts = sched.timestamps(sid)
    assert ts["arrival"] <= ts["first_scheduled"] <= ts["first_token"] <= ts["finished"]
    assert sched.finish_reason(sid) == "length" and not sched.has_unfinished()


def test_prompt_engine_hands_back_block_tables():
    sched, model = make(engine_type="prompt", max_num_batched_tokens=8)
    sid = sched.add_request(list(range(1, 11)), max_tokens=5)
    out, fin = step(sched, model)
    assert fin == [] and out.emits_tokens.tolist() == [False]
    out, fin = step(sched, model)
    assert fin == [(sid, "prefilled")]
    table = sched.block_table(sid)
    assert table.size == 3 and np.all(sched.block_ref_counts()[table] == 1)
    assert sched.schedule().num_seqs == 0  # nothing more to do: no decode on a PROMPT engine
    sched.release(sid)
    assert sched.stats()["num_free_blocks"] == 32
    sched.check_invariants()


def test_completion_engine_decodes_from_given_blocks():
    sched, model = make(engine_type="completion", num_blocks=12)
    prompt = list(range(1, 11))
    with pytest.raises(ValueError, match="must hold ceil"):
        sched.add_request(prompt, cached_block_ids=[0, 1])
    # Lay the prompt's KV into blocks 5, 6, 7 of the fake cache, as a prefill engine would have.
    blocks = [5, 6, 7]
    for p, t in enumerate(prompt):
        model.kv[blocks[p // 4] * 4 + p % 4] = t
    sid = sched.add_request(prompt, cached_block_ids=blocks, max_tokens=30, ignore_eos=True)
    with pytest.raises(ValueError, match="block 5 is already in use"):
        sched.add_request(prompt, cached_block_ids=[5, 8, 9])
    out, _ = step(sched, model)
    assert not out.any_prefill and out.positions.tolist() == [9] and out.input_ids.tolist() == [10]
    assert out.slot_mapping.tolist() == [7 * 4 + 1]
    # Two more requests fill the 12 blocks; the latest is preempted and, unable to recompute, ends.
    other = [
        sched.add_request(prompt, cached_block_ids=b, max_tokens=30, ignore_eos=True)
        for b in ([0, 1, 2], [3, 4, 8])
    ]
    for b in ([0, 1, 2], [3, 4, 8]):
        for p, t in enumerate(prompt):
            model.kv[b[p // 4] * 4 + p % 4] = t
    drv = Driver(sched, model)
    drv.drain(100)
    assert sched.finish_reason(other[1]) == "preempted" and drv.finished[other[1]] == "preempted"
    spec = RequestSpec(sid, prompt, max_tokens=30, ignore_eos=True)
    assert sched.output_token_ids(sid).tolist() == expected_stream(spec, 48, V)[0]
