"""Paged caches: prefix-cache hits, preemption + recompute, block reuse without stale KV (freed blocks are
poisoned with NaN), cross-layer sharing (a consumer reads exactly its producer's entries), sizing and
input validation. Driven by the real deepinfer_sched scheduler where the behaviour is the scheduler's."""

import logging

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner, cache_specs
from deepinfer_sched import Scheduler, SchedulerConfig

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41"), seed=1))


def _batch(entries):
    """entries: (seq_id, start, query tokens, block table, logits_len)."""
    return StepBatch.of(
        seq_ids=np.array([e[0] for e in entries]),
        start_positions=np.array([e[1] for e in entries]),
        query_lens=np.array([len(e[2]) for e in entries]),
        block_tables=[np.array(e[3], dtype=np.int32) for e in entries],
        input_ids=np.concatenate([np.array(e[2], dtype=np.int64) for e in entries]),
        logits_lens=np.array([e[4] for e in entries]),
    )


def _ref(model, tokens):
    return model.forward(torch.tensor(tokens)).logits


def test_scheduler_driven_prefix_hits_preemption_and_poisoned_free_blocks(model):
    """Few blocks force preemption (recompute from scratch); shared prompt prefixes hit the prefix cache;
    before every step every free block the prefix cache does not keep is overwritten with NaN, so a read
    of stale KV would surface as NaN logits. Every emitted row equals the stateless forward bitwise."""
    cfg = SchedulerConfig(
        num_blocks=14,
        block_size=BLOCK,
        max_num_batched_tokens=12,
        max_model_len=40,
        enable_prefix_caching=True,
    )
    sched = Scheduler(cfg)
    runner = PagedRunner(model, num_blocks=14, block_size=BLOCK)
    rng = np.random.default_rng(0)
    shared = rng.integers(4, 256, 9).tolist()
    prompts = [shared + rng.integers(4, 256, int(rng.integers(1, 6))).tolist() for _ in range(4)]
    prompts.append(rng.integers(4, 256, 13).tolist())
    seqs = {sched.add_request(p, max_tokens=6, ignore_eos=True): list(p) for p in prompts}
    emitted = 0
    while sched.has_unfinished():
        out = sched.schedule()
        stale = [b for b in np.asarray(sched.free_block_ids()).tolist() if not sched.is_block_cached(b)]
        if stale:
            runner.cache.poison(stale)
        logits = runner.execute(out)
        emits = np.asarray(out.emits_tokens)
        tokens, row = [], 0
        for i, sid in enumerate(np.asarray(out.seq_ids).tolist()):
            if not emits[i]:
                tokens.append(0)
                continue
            assert torch.equal(logits[row], _ref(model, seqs[sid])[-1])
            tok = int(torch.argmax(logits[row]))
            seqs[sid].append(tok)
            tokens.append(tok)
            row += 1
            emitted += 1
        sched.update_from_output(out, np.array(tokens, dtype=np.int32))
    stats = sched.stats()
    assert emitted == 5 * 6
    assert stats["num_preemptions"] > 0  # some sequence was recomputed from scratch
    assert stats["prefix_cache_hit_tokens"] > 0  # and some prompt reused another's blocks


def test_prefix_hit_and_reuse_of_a_freed_block(model):
    runner = PagedRunner(model, num_blocks=8, block_size=BLOCK)
    prefix = [5, 6, 7, 8, 11, 12, 13, 14]
    a, b = prefix + [9, 10, 15], prefix + [16, 17]
    runner.execute(_batch([(0, 0, a, [0, 4, 1], 1)]))
    # b hits a's two cached prefix blocks and computes only its suffix
    logits = runner.execute(_batch([(1, 8, b[8:], [0, 4, 2], 2)]))
    assert torch.equal(logits, _ref(model, b)[-2:])
    # a is freed; its last block (1) is poisoned and handed to c, whose tokens overwrite the slots
    runner.cache.poison([1])
    c = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    logits = runner.execute(_batch([(2, 0, c, [3, 5, 1], 3)]))
    assert torch.equal(logits, _ref(model, c)[-3:])


def test_poisoned_context_reaches_the_logits(model):
    """The stale-KV detector works: a step whose context lies in a poisoned block yields NaN."""
    runner = PagedRunner(model, num_blocks=4, block_size=BLOCK)
    toks = list(range(10, 19))
    runner.execute(_batch([(0, 0, toks[:8], [0, 1, 2], 1)]))
    runner.cache.poison([1])
    logits = runner.execute(_batch([(0, 8, toks[8:], [0, 1, 2], 1)]))
    assert torch.isnan(logits).any()


def test_consumers_read_exactly_their_producers_entries(model):
    """Only source layers own compressed / index-K pools; what a consumer attends to (the stateless
    trace of a consumer layer) is, entry for entry, the producer's pool content."""
    topo = model.config.topology
    names = {s.name for s in cache_specs(model, BLOCK)}
    for layer in range(topo.num_layers):
        assert (f"comp.{layer}" in names) == topo.is_kv_source(layer)
        assert (f"index_k.{layer}" in names) == topo.is_index_k_source(layer)
    toks = np.random.default_rng(3).integers(4, 256, 23).tolist()
    runner = PagedRunner(model, num_blocks=8, block_size=BLOCK)
    table = [6, 2, 7, 0, 3, 5]
    runner.execute(_batch([(0, 0, toks[:10], table, 0)]))
    runner.execute(_batch([(0, 10, toks[10:], table, 1)]))
    trace = model.forward(torch.tensor(toks), return_trace=True).trace
    meta_table = np.array(table)
    consumers = [
        layer
        for layer in range(topo.num_layers)
        if topo.kv_source[layer] is not None and not topo.is_kv_source(layer)
    ]
    assert consumers
    for layer in consumers:
        src, ratio = topo.kv_source[layer], model.config.compress_ratios[layer]
        n = len(toks) // ratio
        first = np.arange(n) * ratio
        per = max(1, BLOCK // ratio)
        slots = torch.from_numpy(meta_table[first // BLOCK] * per + (first % BLOCK) // ratio)
        assert torch.equal(runner.cache.read(f"comp.{src}", slots), trace[layer].compressed.keys)
        ik = runner.cache.read(f"index_k.{topo.index_k_source[layer]}", slots)
        assert torch.equal(ik, trace[layer].index_keys)


def test_sizing_from_a_byte_budget_logs_blocks(model, caplog):
    per_block = PagedRunner.bytes_per_block(model, BLOCK)
    # swa of every layer + each source's entries + the C2 source's compressor state + token ids
    assert per_block > model.config.num_hidden_layers * BLOCK * model.config.head_dim * 4
    with caplog.at_level(logging.INFO, logger="deepinfer_model.runtime"):
        runner = PagedRunner.from_memory(model, BLOCK, kv_cache_memory_bytes=10 * per_block + 5)
    assert runner.num_blocks == 10
    assert runner.cache.nbytes == 10 * per_block
    assert "10 blocks" in caplog.text
    with pytest.raises(ValueError, match="below one block"):
        PagedRunner.from_memory(model, BLOCK, kv_cache_memory_bytes=per_block - 1)
    with pytest.raises(ValueError, match="memory_fraction"):
        PagedRunner.from_memory(model, BLOCK, memory_fraction=1.5)
    assert PagedRunner.from_memory(model, BLOCK, memory_fraction=1e-3).num_blocks >= 1


def test_bad_inputs_are_rejected(model):
    runner = PagedRunner(model, num_blocks=2, block_size=BLOCK)
    with pytest.raises(ValueError, match="token ids"):
        runner.execute(_batch([(0, 0, [model.config.vocab_size], [0], 1)]))
    with pytest.raises(ValueError, match="block table"):
        runner.execute(_batch([(0, 0, list(range(9)), [0], 1)]))
    with pytest.raises(ValueError, match="block ids"):
        runner.execute(_batch([(0, 0, [5, 6], [7], 1)]))
    with pytest.raises(ValueError, match="num_blocks"):
        PagedRunner(model, num_blocks=0, block_size=BLOCK)
    with pytest.raises(ValueError, match="divide"):
        PagedRunner(model, num_blocks=2, block_size=3)  # C2 entries would straddle blocks


def test_rejected_verification_tokens_are_rolled_back(model):
    """A verification step writes 5 draft positions (crossing C2 block boundaries); the scheduler then
    keeps only the first and the next step restarts right after it with other tokens: the cached
    entries of the rejected positions are recomputed, never read."""
    runner = PagedRunner(model, num_blocks=6, block_size=BLOCK)
    table = [4, 1, 5, 0]
    prompt = list(range(40, 49))
    runner.execute(_batch([(0, 0, prompt, table, 1)]))
    draft = [60, 61, 62, 63, 64]
    got = runner.execute(_batch([(0, 9, draft, table, 5)]))
    assert torch.equal(got, _ref(model, prompt + draft)[-5:])
    accepted = prompt + draft[:1]
    fixed = [70, 71, 72]
    got = runner.execute(_batch([(0, 10, fixed, table, 3)]))
    assert torch.equal(got, _ref(model, accepted + fixed)[-3:])


def test_make_runner_switch(model):
    from deepinfer_model.runner import RecomputeRunner
    from deepinfer_model.runtime import make_runner

    assert isinstance(make_runner("paged", model, 4, BLOCK), PagedRunner)
    assert isinstance(make_runner("recompute", model, 4, BLOCK), RecomputeRunner)
    with pytest.raises(ValueError, match="runner must be one of"):
        make_runner("fast", model, 4, BLOCK)


def test_sequences_without_query_tokens_are_skipped(model):
    runner = PagedRunner(model, num_blocks=4, block_size=BLOCK)
    toks = [9, 8, 7, 6, 5]
    got = runner.execute(_batch([(0, 0, toks, [0, 1], 1), (1, 3, [], [2], 0)]))
    assert torch.equal(got, _ref(model, toks)[-1:])
    assert runner.execute(_batch([(1, 3, [], [2], 0)])).shape == (0, model.config.vocab_size)
