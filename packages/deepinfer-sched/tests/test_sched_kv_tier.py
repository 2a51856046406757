"""The scheduler's side of a lower KV tier: evicted cached blocks are reported with their keys, keys the
engine declares loadable turn prefix misses into loads, and a fake tier kept beside the fake model's KV
proves every loaded block holds exactly the tokens the scheduler counts as computed."""

import numpy as np
import pytest
from deepinfer_sched import Scheduler, SchedulerConfig
from deepinfer_sched.testing import FakeModel, RequestSpec, expected_stream

V = 31


def make(report=True, bits=64, **kw):
    base = dict(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    base.update(kw)
    cfg = SchedulerConfig(prefix_hash_bits=bits, report_evictions=report, **base)
    return Scheduler(cfg), FakeModel(cfg.num_blocks, cfg.block_size, V)


class FakeTier:
    """Keeps evicted blocks' fake KV under their keys and writes it back for loads (what the engine
    does with the model's pools)."""

    def __init__(self, sched, model, capacity=10**9):
        self.sched, self.model, self.capacity = sched, model, capacity
        self.entries: dict[tuple[int, int], np.ndarray] = {}
        self.loaded = 0

    def transfer(self, out):
        """The order that keeps both sides right: fetch the loads' entries first (storing evicted blocks
        may drop them), read the evicted blocks (a load may target one of them), then write the loads."""
        bs = self.model.block_size
        seqs, idx, blocks, hashes, checks = out.block_loads
        fetched = []
        for s, i, b, h, c in zip(
            seqs.tolist(), idx.tolist(), blocks.tolist(), hashes.tolist(), checks.tolist()
        ):
            kv = self.entries[(h, c)]
            assert kv.tolist() == self.sched.token_ids(s)[i * bs : (i + 1) * bs].tolist()
            fetched.append((b, kv))
        ids, hashes, checks, tokens = out.evicted_blocks
        for b, h, c, t in zip(ids.tolist(), hashes.tolist(), checks.tolist(), tokens):
            kv = self.model.kv[b * bs : (b + 1) * bs].copy()
            assert kv.tolist() == t.tolist()  # the pools still hold the evicted content
            self.entries[(h, c)] = kv
            self.sched.add_loadable(np.array([h], np.uint64), np.array([c], np.uint64))
        while len(self.entries) > self.capacity:
            (h, c) = next(iter(self.entries))
            del self.entries[(h, c)]
            self.sched.drop_loadable(np.array([h], np.uint64), np.array([c], np.uint64))
        for b, kv in fetched:
            self.model.kv[b * bs : (b + 1) * bs] = kv
            self.loaded += 1


def run(sched, model, tier, specs, max_model_len=32):
    for spec in specs:
        sched.add_request(spec.prompt, seq_id=spec.seq_id, max_tokens=spec.max_tokens)
    got = {}
    while sched.has_unfinished():
        out = sched.schedule()
        if tier is not None:
            tier.transfer(out)
        for f in sched.update_from_output(out, model.run(sched, out)):
            got[f.seq_id] = (sched.output_token_ids(f.seq_id).tolist(), f.finish_reason)
        sched.check_invariants()
    for spec in specs:
        assert got[spec.seq_id] == expected_stream(spec, max_model_len, V)
    return got


def test_evicted_blocks_are_reported_with_their_keys_and_tokens():
    sched, model = make()
    a = sched.add_request(list(range(1, 11)), max_tokens=1)  # two full blocks + 2
    out = sched.schedule()
    assert out.evicted_blocks[0].size == 0 and not out.has_tier_transfers
    sched.update_from_output(out, model.run(sched, out))  # a finishes: its blocks freed, still cached
    assert sched.stats()["num_cached_free_blocks"] == 2
    b = sched.add_request(list(range(20, 49)), max_tokens=1)  # 29 tokens: needs all 8 blocks
    out = sched.schedule()
    ids, hashes, checks, tokens = out.evicted_blocks
    assert sorted(tokens.tolist()) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert len(set(hashes.tolist())) == 2 and len(set(checks.tolist())) == 2
    assert set(ids.tolist()) <= set(sched.block_table(b).tolist())
    assert sched.stats()["num_evicted_blocks"] == 2
    del a


def test_no_report_without_the_setting():
    sched, model = make(report=False)
    run(sched, model, None, [RequestSpec(0, list(range(1, 11)), 1), RequestSpec(1, list(range(20, 49)), 1)])
    assert sched.stats()["num_evicted_blocks"] == 0


def test_loadable_keys_become_loads_past_the_device_hit():
    sched, model = make()
    tier = FakeTier(sched, model)
    prompt = list(range(1, 15))  # three full blocks + 2
    run(sched, model, tier, [RequestSpec(0, prompt, 1), RequestSpec(1, list(range(20, 49)), 1)])
    assert len(tier.entries) == 3
    c = sched.add_request(prompt + [3, 3], seq_id=2, max_tokens=2)
    out = sched.schedule()
    seqs, idx, blocks, _, _ = out.block_loads
    assert seqs.tolist() == [c] * 3 and idx.tolist() == [0, 1, 2]
    assert blocks.tolist() == sched.block_table(c)[:3].tolist()
    row = out.seq_ids.tolist().index(c)
    assert out.start_positions[row] == 12 and out.query_lens[row] == 4
    assert sched.num_cached_tokens(c) == 12 and sched.num_loaded_tokens(c) == 12
    tier.transfer(out)
    sched.update_from_output(out, model.run(sched, out))
    sched.check_invariants()
    st = sched.stats()
    assert st["tier_hit_tokens"] == 12
    # loaded blocks are registered on the device: the next request hits them there
    d = sched.add_request(prompt + [4], seq_id=3, max_tokens=1)
    out = sched.schedule()
    assert out.block_loads[0].size == 0 and sched.num_cached_tokens(d) == 12
    tier.transfer(out)
    sched.update_from_output(out, model.run(sched, out))


def test_device_hit_then_tier_hit():
    """The first blocks still on the device, the rest only in the tier: one admission takes both."""
    sched, model = make(num_blocks=10)
    tier = FakeTier(sched, model)
    prompt = list(range(1, 18))  # four full blocks + 1
    run(sched, model, tier, [RequestSpec(0, prompt, 1)])
    # 26 tokens take the 6 never-cached blocks and evict one: the prompt's last full block (a table is
    # freed tail first, so its tail is evicted first)
    run(sched, model, tier, [RequestSpec(1, list(range(20, 46)), 1)])
    assert [kv.tolist() for kv in tier.entries.values()] == [[13, 14, 15, 16]]
    c = sched.add_request(prompt + [9], seq_id=2, max_tokens=2)
    out = sched.schedule()
    assert out.block_loads[1].tolist() == [3]  # blocks 0-2 on the device, block 3 loaded
    assert sched.num_cached_tokens(c) == 16 and sched.num_loaded_tokens(c) == 4
    tier.transfer(out)
    sched.update_from_output(out, model.run(sched, out))
    sched.check_invariants()
    st = sched.stats()
    assert st["tier_hit_tokens"] == 4 and st["prefix_cache_hit_tokens"] == 12


def test_salt_and_check_keep_keys_apart():
    sched, model = make(bits=0)  # every device hash collides: only the check keeps tier keys apart
    tier = FakeTier(sched, model)
    prompt = list(range(1, 11))
    run(sched, model, tier, [RequestSpec(0, prompt, 1), RequestSpec(1, list(range(20, 49)), 1)])
    assert len(tier.entries) == 2
    other = sched.add_request([9, 9, 9, 9, 9, 9, 9, 9, 1], seq_id=2, max_tokens=1)
    out = sched.schedule()
    assert out.block_loads[0].size == 0 and sched.num_cached_tokens(other) == 0
    tier.transfer(out)
    sched.update_from_output(out, model.run(sched, out))
    salted = sched.add_request(prompt, seq_id=3, max_tokens=1, cache_salt=5)
    out = sched.schedule()
    assert out.block_loads[0].size == 0 and sched.num_cached_tokens(salted) == 0


def test_dropped_and_uncached_keys_are_not_hit():
    sched, model = make()
    tier = FakeTier(sched, model)
    prompt = list(range(1, 11))
    run(sched, model, tier, [RequestSpec(0, prompt, 1), RequestSpec(1, list(range(20, 49)), 1)])
    (h1, c1) = next(k for k, kv in tier.entries.items() if kv.tolist() == [5, 6, 7, 8])
    sched.drop_loadable(np.array([h1], np.uint64), np.array([c1], np.uint64))
    a = sched.add_request(prompt + [2], seq_id=2, max_tokens=1)
    out = sched.schedule()
    assert out.block_loads[1].tolist() == [0] and sched.num_loaded_tokens(a) == 4
    blocks = out.block_loads[2].tolist()
    tier.transfer(out)
    for b in blocks:  # as if the load had failed: nobody may hit its block on the device
        sched.uncache_block(b)
        assert not sched.is_block_cached(b)
    sched.update_from_output(out, model.run(sched, out))
    sched.check_invariants()
    with pytest.raises(ValueError, match="one length"):
        sched.add_loadable(np.array([1], np.uint64), np.array([], np.uint64))


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_a_bounded_tier_gives_the_expected_streams(seed):
    """Shared prefixes over a device cache too small for them, a tier of a few blocks that drops its
    oldest keys: every stream is the one the fake model dictates, every loaded block checked."""
    rng = np.random.default_rng(seed)
    sched, model = make(num_blocks=12, block_size=2, max_model_len=24, max_num_batched_tokens=10)
    tier = FakeTier(sched, model, capacity=int(rng.integers(2, 12)))
    prefixes = [rng.integers(0, V, int(rng.integers(3, 12))).tolist() for _ in range(3)]
    specs = []
    for i in range(14):
        p = prefixes[int(rng.integers(0, 3))] + rng.integers(0, V, int(rng.integers(1, 4))).tolist()
        specs.append(RequestSpec(i, p, int(rng.integers(1, 5))))
    for lo in range(0, 14, 3):
        run(sched, model, tier, specs[lo : lo + 3], max_model_len=24)
    assert tier.loaded > 0


def test_a_load_that_failed_is_recomputed_after_requeue():
    """The engine could not load what the scheduler counted as loaded: it forgets the block and sends the
    sequence back (`requeue`); reconcile drops its entry, and the next schedule recomputes the prompt, whose
    stream is the fake model's exactly (the fake model checks every KV it reads)."""
    sched, model = make()
    tier = FakeTier(sched, model)
    prompt = list(range(1, 15))
    run(sched, model, tier, [RequestSpec(0, prompt, 1), RequestSpec(1, list(range(20, 49)), 1)])
    spec = RequestSpec(2, prompt + [3, 3], 3)
    c = sched.add_request(spec.prompt, seq_id=spec.seq_id, max_tokens=spec.max_tokens)
    out = sched.schedule()
    blocks = out.block_loads[2].tolist()
    assert len(blocks) == 3
    for b in blocks:  # the load failed: nothing written, the block forgotten, its key gone from the tier
        sched.uncache_block(b)
    for h, k in zip(out.block_loads[3].tolist(), out.block_loads[4].tolist()):
        tier.entries.pop((h, k))
        sched.drop_loadable(np.array([h], np.uint64), np.array([k], np.uint64))
    assert sched.requeue(c, out)
    out = sched.reconcile(out)
    assert out.is_empty and sched.waiting_ids() == [c] and sched.stats()["num_preemptions"] == 1
    sched.update_from_output(out, [])
    got = {}
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.block_loads[0].size == 0  # recomputed, not loaded
        for f in sched.update_from_output(out, model.run(sched, out)):
            got[f.seq_id] = (sched.output_token_ids(f.seq_id).tolist(), f.finish_reason)
        sched.check_invariants()
    assert got[c] == expected_stream(spec, 32, V)


def test_requeue_refuses_what_it_cannot_do():
    sched, _ = make(finish_preempted=True)
    a = sched.add_request([1, 2, 3], max_tokens=2)
    out = sched.schedule()
    assert not sched.requeue(a, out)  # a preempted sequence would finish here: the caller fails it
    sched2, model2 = make()
    b = sched2.add_request([1, 2, 3], max_tokens=2)
    w = sched2.add_request([4, 5], max_tokens=2, priority=1)
    first = sched2.schedule()
    sched2.update_from_output(first, model2.run(sched2, first))
    second = sched2.schedule()
    with pytest.raises(ValueError, match="not running"):
        sched2.requeue(sched2.add_request([6], max_tokens=1), second)
    sched2.update_from_output(second, model2.run(sched2, second))
    third = sched2.schedule()
    with pytest.raises(ValueError, match="latest step"):
        sched2.requeue(b, second)
    del w, third
