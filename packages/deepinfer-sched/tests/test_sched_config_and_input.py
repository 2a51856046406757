"""Invalid configs and requests raise ValueError naming the field; the scheduler stays usable."""

import numpy as np
import pytest
from deepinfer_sched import EngineType, Scheduler, SchedulerConfig
from deepinfer_sched.testing import FakeModel, RequestSpec, expected_stream


def small(**kw):
    base = dict(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    base.update(kw)
    return SchedulerConfig(**base)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(block_size=96), "block_size must be a power of two"),
        (dict(block_size=0), "block_size must be a power of two"),
        (dict(num_blocks=7), r"num_blocks must be >= ceil\(max_model_len / block_size\) = 8"),
        (dict(max_num_batched_tokens=3), r"max_num_batched_tokens must be >= block_size \(4\)"),
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
        (dict(max_model_len=1), "max_model_len must be >= 2"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens must be in"),
        (dict(enable_chunked_prefill=False), r"max_num_batched_tokens must be >= max_model_len \(32\)"),
        (dict(engine_type="decode"), "engine_type must be one of"),
        (dict(block_size=4.0), "block_size must be an int"),
        (dict(prefix_hash_bits=65), r"prefix_hash_bits must be in \[0, 64\]"),
    ],
)
def test_invalid_config_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        small(**kw)


def test_default_block_size_is_128_and_64_works():
    assert SchedulerConfig(num_blocks=64).block_size == 128
    cfg = SchedulerConfig(num_blocks=8, block_size=64, max_model_len=512, max_num_batched_tokens=512)
    sched = Scheduler(cfg)
    sid = sched.add_request(np.arange(130, dtype=np.int32), max_tokens=2)
    out = sched.schedule()
    assert out.block_tables.shape == (1, 3)  # 130 tokens over 64-token blocks
    assert out.slot_mapping[129] == out.block_tables[0, 2] * 64 + 1
    sched.update_from_output(out, np.array([5], dtype=np.int32))
    assert sched.output_token_ids(sid).tolist() == [5]
    assert (
        SchedulerConfig(num_blocks=3, engine_type="prompt", max_model_len=256).engine_type
        is EngineType.PROMPT
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_token_ids=[]), "prompt_token_ids must not be empty"),
        (dict(prompt_token_ids=list(range(32))), "at most max_model_len - 1 = 31"),
        (dict(prompt_token_ids=[1, -2]), "prompt_token_ids must be >= 0"),
        (dict(prompt_token_ids=[1.5]), "prompt_token_ids must hold integers"),
        (dict(prompt_token_ids=[1], max_tokens=0), "max_tokens must be >= 1"),
        (
            dict(prompt_token_ids=[1], max_tokens=2, min_tokens=3),
            r"min_tokens must be in \[0, max_tokens=2\]",
        ),
        (dict(prompt_token_ids=[1], stop_token_ids=[-1]), "stop_token_ids must be >= 0"),
        (dict(prompt_token_ids=[1], eos_token_id=-3), "eos_token_id must be >= 0"),
        (dict(prompt_token_ids=[1], seq_id=-5), "seq_id must be a non-negative integer"),
        (dict(prompt_token_ids=[1], cached_block_ids=[0]), "only accepted by a COMPLETION engine"),
        (dict(prompt_token_ids=[1], priority=2**40), "priority must be an int32"),
    ],
)
def test_bad_requests_raise_and_leave_scheduler_usable(kwargs, message):
    sched = Scheduler(small())
    good = RequestSpec(seq_id=7, prompt=[3, 1, 4, 1, 5], max_tokens=6, eos_token_id=0)
    sched.add_request(good.prompt, seq_id=7, max_tokens=6, eos_token_id=0)
    with pytest.raises(ValueError, match=message):
        sched.add_request(**kwargs)
    sched.check_invariants()
    assert sched.num_unfinished == 1
    model = FakeModel(16, 4, vocab_size=23)
    for _ in range(20):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update_from_output(out, model.run(sched, out))
    tokens, reason = expected_stream(good, 32, 23)
    assert sched.output_token_ids(7).tolist() == tokens and sched.finish_reason(7) == reason


def test_unknown_and_duplicate_ids():
    sched = Scheduler(small())
    sid = sched.add_request([1, 2, 3])
    with pytest.raises(ValueError, match=f"seq_id {sid} is already in use"):
        sched.add_request([1], seq_id=sid)
    for call in (sched.abort, sched.status, sched.finish_reason, sched.output_token_ids, sched.release):
        with pytest.raises(ValueError, match="seq_id 99 is unknown"):
            call(99)
    with pytest.raises(ValueError, match="has not finished"):
        sched.release(sid)
    assert sched.abort(sid) is True and sched.abort(sid) is False
    sched.release(sid)
    with pytest.raises(ValueError, match="is unknown"):
        sched.status(sid)
    assert sched.add_request([1, 2], seq_id=sid) == sid  # a released id can be used again


def test_malformed_sampled_tokens_leave_no_trace():
    sched = Scheduler(small(num_speculative_tokens=2))
    a = sched.add_request([1, 2, 3], max_tokens=8)
    b = sched.add_request([4, 5, 6], max_tokens=8)
    out = sched.schedule()
    with pytest.raises(ValueError, match="expected sampled tokens for 2 scheduled sequences"):
        sched.update_from_output(out, np.array([1], dtype=np.int32))
    with pytest.raises(ValueError, match="must receive between 1 and 1"):
        sched.update_from_output(out, [[1, 2], [3]])
    with pytest.raises(ValueError, match=r"negative token id \(-1\)"):
        sched.update_from_output(out, np.array([9, -1], dtype=np.int32))
    sched.update_from_output(out, [[9], [8]])  # the step is still pending and can be processed
    sched.set_draft_tokens(a, [10, 11])
    with pytest.raises(ValueError, match="at most num_speculative_tokens = 2"):
        sched.set_draft_tokens(a, [1, 2, 3])
    out = sched.schedule()
    assert out.query_lens.tolist() == [3, 1] and out.input_ids.tolist() == [9, 10, 11, 8]
    with pytest.raises(ValueError, match=r"token 0 \(12\) is not the draft it claims to accept \(10\)"):
        sched.update_from_output(out, [[12, 13], [7]])
    finished = sched.update_from_output(out, [[10, 11, 14], [7]])
    assert finished == []
    assert sched.output_token_ids(a).tolist() == [9, 10, 11, 14]
    assert sched.output_token_ids(b).tolist() == [8, 7]
    sched.check_invariants()
