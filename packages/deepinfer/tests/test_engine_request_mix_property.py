"""Property: whatever a batch of requests carries, mostly invalid, and whenever some are aborted, every
request that enters the engine ends exactly as it ends alone, every rejected one is rejected with a
ValueError, and the engine then serves the next batch with its scheduler consistent and every block free.

Checked in the asynchronous and the synchronous loops (the micro public V4: no draft blocks, so no
drafts), and on the tiny V4.1 with DSpark draft blocks with drafts off (nextn 0) and at their default
(DEEPINFER_USE_NEXTN_DECODE unset: 5), so that the mixes also run through speculative verification.
"""

import functools

import pytest
from deepinfer import SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_LEN = 48  # the engine's max_model_len


@functools.cache
def request_mixes(vocab: int, valid: bool = False):
    """Batches of (prompt, SamplingParams fields) for a model of `vocab` tokens: mostly invalid, or
    (`valid`) all accepted at the door, some of which run out of legal tokens."""

    def pick(good: list, bad: list):
        return st.sampled_from(good if valid else good + bad)

    good_id = st.integers(0, vocab - 1)
    bad_id = st.sampled_from([-5, -1, vocab, vocab + 88, 2**31, 2**40])
    token_id = good_id if valid else st.one_of(good_id, good_id, bad_id)
    prompts = st.lists(good_id, min_size=1, max_size=8)
    if not valid:
        prompts = st.one_of(
            prompts,
            st.lists(token_id, min_size=1, max_size=8),
            st.just([]),
            st.just([3] * MAX_LEN),  # too long
        )
    params = st.fixed_dictionaries(
        {
            "temperature": pick([0.0, 0.0, 0.7, 1.0], [1e-300, float("inf"), -1.0]),
            "top_p": pick([1.0, 1.0, 0.9], [0.0, 2.0]),
            "max_tokens": pick([1, 2, 3, 4], [-1]),
            "min_tokens": st.sampled_from([0, 0, 1, 2]),
            "ignore_eos": st.booleans(),
            "seq_seed": st.integers(0, 2**64),
            "golden_token_ids": st.one_of(st.none(), st.none(), st.lists(token_id, max_size=3)),
            # every token a stop token: with min_tokens, a row with no token left
            "stop_token_ids": st.one_of(
                st.just([]), st.lists(token_id, max_size=3), st.just(list(range(vocab)))
            ),
            "so_args": pick(
                [None, None, None, {"schema_type": "ebnf", "schema": 'root ::= root "a"'}],  # accepts nothing
                [
                    {"bogus": 1},
                    {"schema_type": "regex", "schema": "a", "trigger_token_ids": [vocab]},
                    {"schema_type": "regex", "schema": "a", "trigger_token_ids": [5], "bound_token_id": -3},
                    {"schema_type": "nope"},
                ],
            ),
        }
    )
    return st.lists(st.tuples(prompts, params), min_size=1, max_size=6)


aborts = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), max_size=3)  # (request, step)

NEXT = ([[0, 9, 8, 7], [0, 200, 2]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
ENGINES = {  # id: (checkpoint, async loop, nextn (None: the default), drafts expected)
    "async": ("micro", True, None, 0),
    "sync": ("micro", False, None, 0),
    "v41-nextn0": ("v41", True, 0, 0),
    "v41-drafts": ("v41", True, None, 5),
}


@pytest.fixture(scope="module")
def v41_path(tmp_path_factory):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-mixes"), seed=0)


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, micro_checkpoint, share_loaded_models):
    checkpoint, use_async, nextn, drafts = ENGINES[request.param]
    path = micro_checkpoint if checkpoint == "micro" else request.getfixturevalue("v41_path")
    args = EngineArgs(model=str(path), block_size=16, max_model_len=MAX_LEN, async_scheduling=use_async)
    with pytest.MonkeyPatch.context() as m:
        m.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
        engine = LLMEngine(args, num_speculative_tokens=nextn)
    assert engine.num_speculative_tokens == drafts
    engine.solo_cache = {}
    engine.next_reference = _run(engine, [(p, NEXT[1]) for p in NEXT[0]])
    if drafts:
        assert engine.spec_stats()["verified"] > 0  # the next batch runs through verification
    yield engine
    engine.close()


def _run(engine, batch, aborts=()):
    """Add each (prompt, SamplingParams) and step to the end, aborting (index, step) on the way; returns
    per request its (error, token ids, finish reason), or the ValueError add_request raised."""
    _run.counter += 1
    ids, results = [], {}
    for j, (prompt, p) in enumerate(batch):
        rid = f"m{_run.counter}-{j}"
        ids.append(rid)
        try:
            engine.add_request(rid, None, p, prompt_token_ids=prompt)
        except ValueError as e:
            results[rid] = e
    step = 0
    while engine.has_unfinished_requests():
        for j, at in aborts:
            if at == step and j < len(ids):
                engine.abort_request(ids[j])
        for o in engine.step():
            c = o.outputs[0]
            results[o.request_id] = (o.error, c.token_ids, c.finish_reason)
        engine.scheduler.check_invariants()
        step += 1
    return [results[r] for r in ids]


_run.counter = 0


def _solo(engine, prompt, p):
    key = (tuple(prompt), repr(p))
    if key not in engine.solo_cache:
        engine.solo_cache[key] = _run(engine, [(prompt, p)])[0]
    return engine.solo_cache[key]


def check_mix(engine, drawn, abort_at, engine_clean):
    batch, rejected = [], set()
    for j, (prompt, fields) in enumerate(drawn):
        try:
            batch.append((prompt, SamplingParams(**fields)))
        except ValueError:
            rejected.add(j)
    kept = [j for j in range(len(drawn)) if j not in rejected]
    aborted = {kept.index(j): at for j, at in abort_at if j in kept}
    outs = _run(engine, batch, aborts=list(aborted.items()))
    engine_clean(engine)
    for k, out in enumerate(outs):
        prompt, p = batch[k]
        if isinstance(out, ValueError):  # rejected at the door, naming what is wrong
            assert str(out)
            continue
        error, tokens, reason = out
        solo = _solo(engine, prompt, p)
        assert not isinstance(solo, ValueError)
        if k in aborted and reason == "abort":
            assert error is None and tokens == solo[1][: len(tokens)]
        else:
            assert out == solo, (prompt, p)
    engine_clean(engine)
    assert _run(engine, [(p, NEXT[1]) for p in NEXT[0]]) == engine.next_reference
    engine_clean(engine)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=8, **SETTINGS)
@given(data=st.data(), abort_at=aborts)
def test_random_request_mixes(engine, data, abort_at, engine_clean):
    check_mix(engine, data.draw(request_mixes(engine.vocab_size)), abort_at, engine_clean)


@settings(max_examples=8, **SETTINGS)
@given(data=st.data(), abort_at=aborts)
def test_random_valid_request_mixes(engine, data, abort_at, engine_clean):
    check_mix(engine, data.draw(request_mixes(engine.vocab_size, valid=True)), abort_at, engine_clean)


@pytest.mark.slow
@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), abort_at=aborts)
def test_random_request_mixes_long(engine, data, abort_at, engine_clean):
    check_mix(engine, data.draw(request_mixes(engine.vocab_size)), abort_at, engine_clean)
