"""The recompute runner returns exactly the stateless forward's logits for any chunking / batch mix."""

import numpy as np
import pytest
import torch
from deepinfer_model import load_model
from deepinfer_model.runner import RecomputeRunner, StepBatch
from deepinfer_model.testing import make_checkpoint
from deepinfer_model.testing.checkpoint import tiny_config

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # two layers (sliding window + compressed sparse attention): every attention kind the runner must
    # reproduce across chunk boundaries, at a fraction of the full tiny config's cost
    cfg = tiny_config(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
    )
    path = make_checkpoint(tmp_path_factory.mktemp("v4"), cfg, seed=3, tokenizer=False)
    return load_model(path)


def _batch(entries):
    """entries: (seq_id, start, tokens of the query, block_table, logits_len)."""
    return StepBatch.of(
        seq_ids=np.array([e[0] for e in entries], dtype=np.int64),
        start_positions=np.array([e[1] for e in entries], dtype=np.int64),
        query_lens=np.array([len(e[2]) for e in entries], dtype=np.int64),
        block_tables=[np.array(e[3], dtype=np.int32) for e in entries],
        input_ids=np.concatenate([np.array(e[2], dtype=np.int64) for e in entries]),
        logits_lens=np.array([e[4] for e in entries], dtype=np.int64),
    )


def test_random_chunkings_and_interleavings_match_forward(model):
    rng = np.random.default_rng(0)
    runner = RecomputeRunner(model, num_blocks=64, block_size=BLOCK)
    vocab = model.config.vocab_size
    seqs = {}
    free_blocks = list(range(64))
    for sid in range(3):
        n = int(rng.integers(9, 23))
        table = [free_blocks.pop() for _ in range(-(-n // BLOCK))]
        seqs[sid] = dict(tokens=rng.integers(0, vocab, n).tolist(), done=0, table=table)
    while any(s["done"] < len(s["tokens"]) for s in seqs.values()):
        entries = []
        for sid, s in seqs.items():
            left = len(s["tokens"]) - s["done"]
            if left == 0 or rng.random() < 0.3:
                continue
            q = int(rng.integers(1, left + 1))
            complete = s["done"] + q == len(s["tokens"])
            n_logits = int(rng.integers(1, q + 1)) if complete else 0
            entries.append((sid, s["done"], s["tokens"][s["done"] : s["done"] + q], s["table"], n_logits))
            s["done"] += q
        if not entries:
            continue
        rng.shuffle(entries)
        logits = runner.execute(_batch(entries))
        row = 0
        for sid, start, query, _, n_logits in entries:
            if n_logits:
                ref = model.forward(torch.tensor(seqs[sid]["tokens"][: start + len(query)]))[-n_logits:]
                assert torch.equal(logits[row : row + n_logits], ref)
                row += n_logits
        assert row == logits.shape[0]


def test_shared_prefix_blocks_and_reuse_after_free(model):
    runner = RecomputeRunner(model, num_blocks=8, block_size=BLOCK)
    prefix = [5, 6, 7, 8, 1, 2, 3, 4]
    a, b = prefix + [9, 10], prefix + [11]
    runner.execute(_batch([(0, 0, a, [0, 4, 1], 1)]))
    # b hits the cached prefix blocks 0 and 4 and only computes its own suffix
    logits = runner.execute(_batch([(1, 8, b[8:], [0, 4, 2], 1)]))
    assert torch.equal(logits[0], model.forward(torch.tensor(b))[-1])
    # block 1 freed and reused by another sequence: new tokens overwrite old ones
    c = [1, 2, 3, 4, 20, 21, 22, 23, 24]
    logits = runner.execute(_batch([(2, 0, c, [3, 5, 1], 1)]))
    assert torch.equal(logits[0], model.forward(torch.tensor(c))[-1])


def test_bad_inputs_are_rejected(model):
    runner = RecomputeRunner(model, num_blocks=2, block_size=BLOCK)
    with pytest.raises(ValueError, match="token ids"):
        runner.execute(_batch([(0, 0, [model.config.vocab_size], [0], 1)]))
    with pytest.raises(ValueError, match="block table"):
        runner.execute(_batch([(0, 0, list(range(9)), [0], 1)]))
    with pytest.raises(ValueError, match="input_ids"):
        StepBatch.of(
            seq_ids=np.array([0]),
            start_positions=np.array([0]),
            query_lens=np.array([3]),
            block_tables=[np.array([0])],
            input_ids=np.array([1, 2]),
            logits_lens=np.array([1]),
        )


def test_executes_a_real_scheduler_output(model):
    """Driven by deepinfer_sched directly: chunked prefill then decode, logits equal the forward."""
    from deepinfer_sched import Scheduler, SchedulerConfig

    sched = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=BLOCK, max_num_batched_tokens=8, max_model_len=64)
    )
    runner = RecomputeRunner(model, num_blocks=16, block_size=BLOCK)
    prompts = {
        sched.add_request(p, max_tokens=2, ignore_eos=True): list(p)
        for p in ([3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8])
    }
    while sched.has_unfinished():
        out = sched.schedule()
        logits = runner.execute(out)
        emits = np.asarray(out.emits_tokens)
        assert logits.shape[0] == int(emits.sum())
        tokens = []
        row = 0
        for i, seq_id in enumerate(np.asarray(out.seq_ids).tolist()):
            if not emits[i]:
                tokens.append(0)
                continue
            ref = model.forward(torch.tensor(prompts[seq_id]))[-1]
            assert torch.equal(logits[row], ref)
            tok = int(torch.argmax(logits[row]))
            prompts[seq_id].append(tok)
            tokens.append(tok)
            row += 1
        sched.update_from_output(out, np.array(tokens, dtype=np.int32))


def test_lockstep_batch_is_every_sequence_at_one_position():
    """`StepBatch.lockstep`: sequence i feeds row i of the ids from `start`, one logits row each."""
    tables = [
        np.array([0, 1], dtype=np.int32),
        np.array([2, 3], dtype=np.int32),
        np.array([4], dtype=np.int32),
    ]
    ids = np.array([[5, 6], [7, 8], [9, 10]])
    b = StepBatch.lockstep(tables, 3, ids)
    assert b.seq_ids.tolist() == [0, 1, 2] and b.start_positions.tolist() == [3, 3, 3]
    assert b.query_lens.tolist() == [2, 2, 2] and b.logits_lens.tolist() == [1, 1, 1]
    assert b.input_ids.tolist() == [5, 6, 7, 8, 9, 10] and b.input_ids.dtype == np.int64
    assert b.table(2).tolist() == tables[2].tolist() and b.block_tables.tolist()[2] == [4, -1]
    assert b.query_start_loc.tolist() == [0, 2, 4, 6] and b.positions.tolist() == [3, 4] * 3
    assert b.seq_lens.tolist() == [5, 5, 5] and b.slot_mapping is None
    assert b.slots(8).tolist() == [3, 4, 19, 20, 35, 36]  # block p // 8 of the table, offset p % 8
    one = StepBatch.lockstep(tables, 5, [[1], [2], [3]])  # a decode step
    assert one.query_lens.tolist() == [1, 1, 1] and one.input_ids.tolist() == [1, 2, 3]
    with pytest.raises(ValueError):
        StepBatch.lockstep(tables, 0, np.arange(7))  # not one row per sequence
