"""Automatic prefix caching: shared full blocks, exact confirmation, LRU retention of freed blocks."""

import numpy as np
import pytest
from deepinfer_sched import Scheduler, SchedulerConfig
from deepinfer_sched.testing import FakeModel

V = 23


def make(bits=64, **kw):
    base = dict(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    base.update(kw)
    cfg = SchedulerConfig(prefix_hash_bits=bits, **base)
    return Scheduler(cfg), FakeModel(cfg.num_blocks, cfg.block_size, V)


def step(sched, model):
    out = sched.schedule()
    fin = sched.update_from_output(out, model.run(sched, out))
    sched.check_invariants()
    return out, fin


@pytest.mark.parametrize("bits", [64, 0])  # 0 bits: every key collides, hits rely on token checks
def test_second_request_reuses_full_prefix_blocks(bits):
    sched, model = make(bits)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # two full blocks + 2 tokens
    a = sched.add_request(prompt, max_tokens=8)
    step(sched, model)
    b = sched.add_request(prompt[:8] + [1, 2, 3], max_tokens=8)
    out, _ = step(sched, model)
    assert sched.num_cached_tokens(b) == 8
    row = out.seq_ids.tolist().index(b)
    assert out.start_positions[row] == 8 and out.query_lens[row] == 3
    ta, tb = sched.block_table(a), sched.block_table(b)
    assert ta[:2].tolist() == tb[:2].tolist() and ta[2] != tb[2]
    refs = sched.block_ref_counts()
    assert refs[ta[0]] == refs[ta[1]] == 2 and refs[ta[2]] == refs[tb[2]] == 1
    st = sched.stats()
    assert st["prefix_cache_hit_tokens"] == 8 and st["prefix_cache_query_tokens"] == 10 + 11


def test_different_first_block_never_matches_later_blocks():
    sched, model = make(bits=0)
    sched.add_request([1, 1, 1, 1, 2, 2, 2, 2, 3], max_tokens=4)
    step(sched, model)
    b = sched.add_request([9, 9, 9, 9, 2, 2, 2, 2, 3], max_tokens=4)  # same 2nd block, other 1st block
    step(sched, model)
    assert sched.num_cached_tokens(b) == 0


def test_hit_leaves_the_last_prompt_token_to_compute():
    sched, model = make()
    prompt = list(range(8))  # exactly two full blocks
    sched.add_request(prompt, max_tokens=2)
    step(sched, model)
    b = sched.add_request(prompt, max_tokens=2)
    out, _ = step(sched, model)
    assert sched.num_cached_tokens(b) == 4  # the second block is recomputed to get its logits
    assert out.start_positions.tolist()[-1] == 4


def test_freed_blocks_stay_cached_until_evicted_lru():
    sched, model = make(num_blocks=8, block_size=2, max_model_len=16, max_num_batched_tokens=16)
    a_prompt, b_prompt = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    a = sched.add_request(a_prompt, max_tokens=4)
    step(sched, model)
    sched.abort(a)  # its two full blocks stay cached (freed first: least recently used)
    b = sched.add_request(b_prompt, max_tokens=4)
    step(sched, model)
    sched.abort(b)
    assert sched.stats()["num_cached_free_blocks"] == 4
    # A request needing 6 of the 8 blocks takes the 2 never-cached ones, then evicts A's blocks
    # (freed before B's), and finishes at once.
    c = sched.add_request(list(range(11, 22)), max_tokens=1)
    _, fin = step(sched, model)
    assert [f.seq_id for f in fin] == [c]
    e = sched.add_request(b_prompt + [0], max_tokens=2)
    d = sched.add_request(a_prompt + [0], max_tokens=2)
    step(sched, model)
    assert sched.num_cached_tokens(e) == 4
    assert sched.num_cached_tokens(d) == 0


def test_prefix_caching_can_be_disabled():
    sched, model = make(enable_prefix_caching=False)
    prompt = list(range(10))
    sched.add_request(prompt, max_tokens=4)
    step(sched, model)
    b = sched.add_request(prompt, max_tokens=4)
    step(sched, model)
    assert sched.num_cached_tokens(b) == 0 and sched.stats()["num_cached_free_blocks"] == 0


def test_block_allocator_free_list_order():
    from deepinfer_sched import BlockAllocator

    alloc = BlockAllocator(4)
    ids = [alloc.allocate() for _ in range(4)]
    alloc.decref(ids[1])
    alloc.decref(ids[3], to_head=True)
    alloc.decref(ids[0])
    assert alloc.free_list() == [ids[3], ids[1], ids[0]]
    assert [alloc.allocate() for _ in range(3)] == [ids[3], ids[1], ids[0]]
    assert np.all([alloc.ref_count(i) == 1 for i in ids])
