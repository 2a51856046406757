"""Draft-aware masks: per-draft rows + rollback must give exactly the tokens of plain decoding,
with a self-drafting oracle whose drafts are sometimes right, sometimes grammar-violating. Also
preemption (rebuild from emitted tokens) and the reference's trigger / bound phases."""

from __future__ import annotations

import random

import deepinfer_structured as ds
import pytest
import torch
from so_common import EOS_ID, VOCAB_SIZE
from so_random_model import RandomModel, closing_ids
from test_so_generation import PERSON_SCHEMA, generate

WORDS = ds.bitmask_words(VOCAB_SIZE)


@pytest.fixture(scope="module")
def model(tokenizer):
    return RandomModel(VOCAB_SIZE, EOS_ID, closing_ids(tokenizer))


def masked_argmax(model, seed, prefix, bitmask, row) -> int:
    logits = model.logits(seed, prefix).unsqueeze(0)
    ds.apply_bitmask_inplace(logits, ds.StepMasks(bitmask[row : row + 1], [0]))
    return int(logits[0].argmax())


def fresh_mask(service, so_args, tokens) -> torch.Tensor:
    """Independent path: a new state fed the tokens one by one, one mask row."""
    state = service.new_state(so_args)
    for t in tokens:
        assert state.accept_token(t)
    out = torch.zeros(1, WORDS, dtype=torch.int32)
    state.fill_next_token_bitmask(out, 0)
    return out[0]


def decode_with_drafts(state, model, seed, truth, k, rng, stats, max_tokens=128):
    """Greedy speculative decoding: the drafter proposes k tokens (the true continuation with random
    corruption: a random id, or the model's unmasked argmax); the verifier checks each position
    with the mask row made for it, accepts the matching prefix and adds its own token."""
    masker = ds.BatchMasker(VOCAB_SIZE, max_threads=1)
    out: list[int] = []
    while len(out) < max_tokens:
        drafts = list(truth[len(out) : len(out) + k])
        drafts += [rng.randrange(VOCAB_SIZE) for _ in range(k - len(drafts))]
        if drafts and rng.random() < 0.5:
            j = rng.randrange(len(drafts))
            drafts[j] = (
                rng.randrange(VOCAB_SIZE)
                if rng.random() < 0.5
                else int(model.logits(seed, out + drafts[:j]).argmax())
            )
        before = state.num_tokens
        masks = masker.fill([ds.MaskRequest(state, 0, drafts)], num_rows=k + 1)
        assert state.num_tokens == before  # drafts were rolled back
        stats["grammar_rejected"] += masks.valid_drafts[0] < k
        accepted = []
        for j in range(k + 1):
            target = masked_argmax(model, seed, out + accepted, masks.bitmask, j)
            if j < k and drafts[j] == target:
                assert j < masks.valid_drafts[0] + 1
                accepted.append(target)
                stats["accepted"] += 1
                continue
            accepted.append(target)
            break
        state.accept_verified(accepted)
        for t in accepted:
            if t == EOS_ID:
                return out
            out.append(t)
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_drafts_and_rollback_match_plain_decoding(service, model, k):
    so_args = {"schema_type": "json_schema", "schema": PERSON_SCHEMA, "max_whitespace": 2}
    state = service.new_state(so_args)
    rng = random.Random(k)
    stats = {"accepted": 0, "grammar_rejected": 0}
    for seed in range(6):
        state.rebuild_from_tokens([])
        truth, _ = generate(state, model, seed)
        state.rebuild_from_tokens([])
        assert decode_with_drafts(state, model, seed, truth, k, rng, stats) == truth
    # Both paths were exercised: drafts accepted, and drafts the grammar itself rejected.
    assert stats["accepted"] > 20 and stats["grammar_rejected"] > 5, stats


def test_each_draft_row_equals_a_fresh_matcher(service, model, tokenizer):
    so_args = {"schema_type": "regex", "schema": r'\{"id": [1-9][0-9]{0,5}, "ok": (true|false)\}'}
    text_ids = tokenizer.encode('{"id": 4711, "ok": true}', add_special_tokens=False).ids
    state = service.new_state(so_args)
    masker = ds.BatchMasker(VOCAB_SIZE, max_threads=1)
    for start in range(len(text_ids)):
        drafts = text_ids[start : start + 4] + [tokenizer.encode("zz", add_special_tokens=False).ids[0]]
        masks = masker.fill([ds.MaskRequest(state, 1, drafts)], num_rows=len(drafts) + 2)
        valid = masks.valid_drafts[0]
        assert valid == min(4, len(text_ids) - start)  # the "zz" draft is rejected
        for j in range(valid + 1):
            expect = fresh_mask(service, so_args, text_ids[:start] + drafts[:j])
            assert torch.equal(masks.bitmask[1 + j], expect), (start, j)
        # Rows after the rejected draft repeat the row that rejects it.
        for j in range(valid + 1, len(drafts) + 1):
            assert torch.equal(masks.bitmask[1 + j], masks.bitmask[1 + valid])
        state.accept_verified([text_ids[start]])


def test_rebuild_after_preemption_restores_the_exact_state(service, model):
    so_args = {"schema_type": "json_schema", "schema": PERSON_SCHEMA, "max_whitespace": 1}
    state = service.new_state(so_args)
    tokens, _ = generate(state, model, seed=3)
    row = torch.zeros(2, WORDS, dtype=torch.int32)
    for cut in (0, 1, len(tokens) // 2, len(tokens)):
        rebuilt = service.new_state(so_args)
        rebuilt.rebuild_from_tokens(tokens[:cut])
        state.rebuild_from_tokens(tokens[:cut])
        rebuilt.fill_next_token_bitmask(row, 0)
        assert torch.equal(row[0], fresh_mask(service, so_args, tokens[:cut]))
        assert rebuilt.num_tokens == cut


def test_rebuild_with_a_forbidden_token_fails_that_request(service, tokenizer):
    state = service.new_state({"schema_type": "regex", "schema": "[0-9]+"})
    bad = tokenizer.encode("12a", add_special_tokens=False).ids
    with pytest.raises(ds.StructuredOutputError, match="violates"):
        state.rebuild_from_tokens(bad)


def test_rollback_is_exact_and_bounded(service, tokenizer):
    state = service.new_state({"schema_type": "regex", "schema": "(ab|cd)+"})
    ids = tokenizer.encode("abcdab", add_special_tokens=False).ids
    row = torch.zeros(2, WORDS, dtype=torch.int32)
    state.fill_next_token_bitmask(row, 0)
    state.accept_verified(ids)
    state.accept_verified([EOS_ID])
    assert state.is_terminated()
    state.rollback(len(ids) + 1)
    state.fill_next_token_bitmask(row, 1)
    assert torch.equal(row[0], row[1]) and not state.is_terminated()
    with pytest.raises(ValueError, match="num_tokens"):
        state.rollback(1)


def test_trigger_then_grammar(service, tokenizer):
    trigger = tokenizer.encode("<json>", add_special_tokens=False).ids
    assert len(trigger) >= 2
    state = service.new_state(
        {"schema_type": "json", "schema": {"type": "integer"}, "trigger_token_ids": trigger}
    )
    row = torch.zeros(1, WORDS, dtype=torch.int32)
    free = tokenizer.encode("hello <j", add_special_tokens=False).ids
    state.accept_verified(free)
    assert state.phase is ds.Phase.FREE and not state.fill_next_token_bitmask(row, 0)
    assert int(row.sum()) == -WORDS  # all bits set
    state.accept_verified(trigger)
    assert state.phase is ds.Phase.GRAMMAR
    assert state.fill_next_token_bitmask(row, 0)
    digits = tokenizer.encode("42", add_special_tokens=False).ids
    assert not state.accept_token(tokenizer.encode("x", add_special_tokens=False).ids[0])
    state.accept_verified(digits + [EOS_ID])
    assert state.is_terminated()
    # Exact rollback across the phase change, back into the free text.
    state.rollback(len(digits) + 1 + len(trigger))
    assert state.phase is ds.Phase.FREE


def test_bound_token_forces_the_rest_of_the_trigger(service, tokenizer):
    trigger = tokenizer.encode("```json\n", add_special_tokens=False).ids
    bound = tokenizer.encode("Answer", add_special_tokens=False).ids[0]
    state = service.new_state(
        {"schema_type": "regex", "schema": "[0-9]", "trigger_token_ids": trigger, "bound_token_id": bound}
    )
    row = torch.zeros(1, WORDS, dtype=torch.int32)
    state.accept_verified([bound])
    for expected in trigger:
        assert state.phase is ds.Phase.FORCING
        assert state.fill_next_token_bitmask(row, 0)
        allowed = ds.unpack_bitmask(row, VOCAB_SIZE)[0].nonzero().flatten().tolist()
        assert allowed == [expected]
        assert not state.accept_token((expected + 1) % VOCAB_SIZE)
        state.accept_verified([expected])
    assert state.phase is ds.Phase.GRAMMAR
