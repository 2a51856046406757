"""Property: any interleaving of accepts and rollbacks (across trigger / forcing / grammar phases)
leaves the state equal to a fresh state fed the surviving tokens — same phase, same mask."""

from __future__ import annotations

import random

import deepinfer_structured as ds
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from so_common import EOS_ID, VOCAB_SIZE

WORDS = ds.bitmask_words(VOCAB_SIZE)


@pytest.fixture(scope="module")
def setup(service, tokenizer):
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    trigger = enc("<a>")
    bound = enc("!")[0]
    so_args = {
        "schema_type": "regex",
        "schema": "[0-9]{1,3}(,[0-9]{1,3})*",
        "trigger_token_ids": trigger,
        "bound_token_id": bound,
    }
    pool = sorted(set(trigger + [bound, EOS_ID] + enc("12,3") + enc("x") + enc("9,")))
    compiled = service.compile(so_args)
    return compiled, ds.parse_so_args(so_args), pool


def snapshot(state: ds.GrammarState) -> tuple:
    row = torch.zeros(1, WORDS, dtype=torch.int32)
    state.fill_next_token_bitmask(row, 0)
    return state.phase, state.is_terminated(), row


KINDS = ["any", "allowed", "allowed", "rollback"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 1000)), min_size=1, max_size=30))
def test_any_accept_rollback_sequence_matches_a_fresh_replay(setup, ops):
    run_ops(setup, ops)


def test_a_long_seeded_sequence_visits_every_phase(setup):
    """Guards against a vacuous strategy: the same operations reach FREE, FORCING and GRAMMAR."""
    rng = random.Random(0)
    ops = [(rng.choice(KINDS), rng.randrange(1000)) for _ in range(60)]
    assert run_ops(setup, ops) == set(ds.Phase)


def run_ops(setup, ops) -> set:
    compiled, request, pool = setup
    state = ds.GrammarState(compiled, request)
    kept: list[int] = []
    seen = set()
    for kind, n in ops:
        if kind != "rollback":
            candidates = pool
            if kind == "allowed":  # steer towards the forced trigger tokens and the grammar phase
                allowed = ds.unpack_bitmask(snapshot(state)[2], VOCAB_SIZE)[0]
                candidates = [t for t in pool if allowed[t]] or pool
            token = candidates[n % len(candidates)]
            if state.accept_token(token):
                kept.append(token)
        else:
            k = n % (len(kept) + 1)
            state.rollback(k)
            del kept[len(kept) - k :]
        fresh = ds.GrammarState(compiled, request)
        fresh.rebuild_from_tokens(kept)
        a, b = snapshot(state), snapshot(fresh)
        assert a[:2] == b[:2] and torch.equal(a[2], b[2]), (ops, kept)
        assert state.num_tokens == len(kept)
        seen.add(state.phase)
    return seen
