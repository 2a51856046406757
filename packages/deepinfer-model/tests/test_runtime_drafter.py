"""V4.1 drafter through the paged runner: the draft-block main keys cached per token, and a drafted block
after each sequence of a mixed step, equal (bitwise) to the stateless forward's `draft`."""

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner

BLOCK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41"), seed=2))


def test_drafts_after_a_mixed_step_equal_the_stateless_draft(model):
    rng = np.random.default_rng(5)
    seqs = [rng.integers(4, 256, n).tolist() for n in (21, 14, 9)]
    tables = [[0, 1, 2], [3, 4], [5, 6]]
    runner = PagedRunner(model, num_blocks=7, block_size=BLOCK)
    # step 1: prefill chunks; step 2: a decode, a 3-token chunk and a final prefill chunk in one batch
    cut = [20, 11, 4]
    for lo, hi in ((np.zeros(3, int), cut), (cut, [len(s) for s in seqs])):
        batch = StepBatch.of(
            seq_ids=np.arange(3),
            start_positions=np.asarray(lo),
            query_lens=np.asarray(hi) - np.asarray(lo),
            block_tables=[np.array(t, dtype=np.int32) for t in tables],
            input_ids=np.concatenate([s[a:b] for s, a, b in zip(seqs, lo, hi)]),
            logits_lens=np.ones(3, dtype=np.int64),
        )
        logits = runner.execute(batch)
    next_tokens = logits.argmax(dim=-1)
    drafts = runner.draft(next_tokens, num_draft_tokens=4)
    for k, toks in enumerate(seqs):
        ref = model.forward(torch.tensor(toks), num_draft_tokens=4, next_token=int(next_tokens[k]))
        pos = np.arange(len(toks))
        slots = torch.from_numpy(np.asarray(tables[k])[pos // BLOCK] * BLOCK + pos % BLOCK)
        for b in range(ref.main_keys.shape[0]):
            assert torch.equal(runner.cache.read(f"draft_main.{b}", slots), ref.main_keys[b])
        assert torch.equal(drafts[k].tokens, ref.draft.tokens)
        assert torch.equal(drafts[k].logits, ref.draft.logits)
        assert torch.equal(drafts[k].confidence, ref.draft.confidence)
    only = runner.draft([int(next_tokens[1])], 2, seq_indices=[1])  # the block is bidirectional: redraft
    ref = model.forward(torch.tensor(seqs[1]), num_draft_tokens=2, next_token=int(next_tokens[1])).draft
    assert len(only) == 1 and torch.equal(only[0].logits, ref.logits)
    with pytest.raises(ValueError, match="one token per drafted sequence"):
        runner.draft([1, 2], 4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        runner.draft(next_tokens, 0)
