"""Every field a request carries is checked against the model when the request enters the engine: a bad
request fails alone with a message naming the field (with `raise_on_error=False`; by default the call
raises), the others of the call complete as they would alone, and the engine keeps serving with every
block free."""

import pytest
from deepinfer import LLM, SamplingParams

VOCAB = 512  # the micro checkpoint's vocabulary
PROMPTS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9]]
GOOD = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, micro_checkpoint, share_loaded_models):
    kw = dict(async_scheduling=request.param, block_size=16, max_model_len=64)
    with LLM(model=str(micro_checkpoint), **kw) as llm:
        yield llm


@pytest.fixture(scope="module")
def solo(llm):
    return llm.generate(prompt_token_ids=PROMPTS[0], sampling_params=GOOD, use_tqdm=False)[0]


def _mixed(llm, bad: SamplingParams | dict, solo, match: str, clean):
    """The bad request beside a good one: it fails alone, naming the field; the good one equals its solo run."""
    outs = llm.generate(
        prompt_token_ids=PROMPTS, sampling_params=[GOOD, bad], use_tqdm=False, raise_on_error=False
    )
    assert outs[0].error is None and outs[0].outputs[0].token_ids == solo.outputs[0].token_ids
    assert outs[1].error is not None and match in outs[1].error, outs[1].error
    assert outs[1].outputs == [] or outs[1].outputs[0].token_ids == []
    clean(llm.engine)
    again = llm.generate(prompt_token_ids=PROMPTS[0], sampling_params=GOOD, use_tqdm=False)[0]
    assert again.error is None and again.outputs[0].token_ids == solo.outputs[0].token_ids
    return outs[1].error


@pytest.mark.parametrize(
    "golden,message",
    [
        ([3, -5], f"golden_token_ids[1]=-5: must be in [0, {VOCAB})"),  # issue item 1
        ([2**40], f"golden_token_ids[0]={2**40}: must be in [0, {VOCAB})"),  # item 2
        ([5, 6, VOCAB + 88], f"golden_token_ids[2]={VOCAB + 88}: must be in [0, {VOCAB})"),  # item 7
    ],
)
def test_golden_token_ids_outside_the_vocabulary_fail_alone(llm, solo, golden, message, engine_clean):
    bad = SamplingParams(temperature=0.0, max_tokens=4, golden_token_ids=golden)
    _mixed(llm, bad, solo, message, engine_clean)


@pytest.mark.parametrize("stop", [[2**40], [VOCAB], [-1 + 2**31]])
def test_stop_token_ids_outside_the_vocabulary_fail_alone(llm, solo, stop, engine_clean):  # issue item 3
    bad = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[3, *stop])
    _mixed(llm, bad, solo, f"stop_token_ids[1]={stop[0]}: must be in [0, {VOCAB})", engine_clean)


def test_prompt_token_ids_name_the_bad_position(llm, solo, engine_clean):
    outs = llm.generate(
        prompt_token_ids=[PROMPTS[0], [0, 5, 2**40], [0, True]],
        sampling_params=GOOD,
        use_tqdm=False,
        raise_on_error=False,
    )
    assert outs[0].outputs[0].token_ids == solo.outputs[0].token_ids
    assert f"prompt_token_ids[2]={2**40}: must be in [0, {VOCAB})" in outs[1].error
    assert "prompt_token_ids[1]=True: must be an integer token id" in outs[2].error
    engine_clean(llm.engine)


def test_raise_on_error_raises_before_anything_runs(llm, solo, engine_clean):
    bad = SamplingParams(temperature=0.0, max_tokens=4, golden_token_ids=[3, -5])
    with pytest.raises(ValueError, match=r"request 1: golden_token_ids\[1\]=-5"):
        llm.generate(
            prompt_token_ids=PROMPTS, sampling_params=[GOOD, bad], raise_on_error=True, use_tqdm=False
        )
    engine_clean(llm.engine)
    bad_grammar = SamplingParams(max_tokens=4, so_args={"schema_type": "regex", "schema": "(?=x)y"})
    with pytest.raises(ValueError, match="request 1: so_args"):
        llm.generate(
            prompt_token_ids=PROMPTS, sampling_params=[GOOD, bad_grammar], raise_on_error=True, use_tqdm=False
        )
    engine_clean(llm.engine)
    again = llm.generate(prompt_token_ids=PROMPTS[0], sampling_params=GOOD, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == solo.outputs[0].token_ids


def test_add_request_checks_before_the_scheduler_sees_anything(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\]=1099511627776"):
        engine.add_request("x", None, SamplingParams(stop_token_ids=[2**40]), prompt_token_ids=[0, 5])
    with pytest.raises(ValueError, match=r"golden_token_ids\[0\]=-1"):
        engine.add_request("x", None, SamplingParams(golden_token_ids=[-1]), prompt_token_ids=[0, 5])
    assert not engine.has_unfinished_requests() and engine.scheduler_stats()["num_waiting"] == 0


@pytest.mark.parametrize("temperature", [1e-300, 1e-9, float("inf"), float("-inf"), 1e308, float("nan")])
def test_temperatures_the_sampler_cannot_take_are_refused(
    llm, solo, temperature, engine_clean
):  # issue item 5
    with pytest.raises(ValueError, match="temperature must be 0"):
        SamplingParams(temperature=temperature)
    _mixed(llm, {"temperature": temperature, "max_tokens": 4}, solo, "temperature must be 0", engine_clean)


def test_temperature_edges_sample(llm, solo):
    from deepinfer_model import MAX_TEMPERATURE, MIN_TEMPERATURE

    edges = [
        SamplingParams(temperature=t, max_tokens=4, ignore_eos=True, seq_seed=7)
        for t in (MIN_TEMPERATURE, MAX_TEMPERATURE)
    ]
    outs = llm.generate(prompt_token_ids=[PROMPTS[0]] * 2, sampling_params=edges, use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 4 for o in outs)
    # the coldest temperature allowed draws the argmax: the greedy tokens
    assert outs[0].outputs[0].token_ids == solo.outputs[0].token_ids


def test_greedy_row_with_every_token_banned_fails_alone(llm, solo, engine_clean):  # issue item 4, greedy twin
    bad = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, stop_token_ids=list(range(VOCAB)))
    _mixed(llm, bad, solo, "no token left", engine_clean)
    sampled = SamplingParams(temperature=1.0, max_tokens=4, min_tokens=3, stop_token_ids=list(range(VOCAB)))
    _mixed(llm, sampled, solo, "no token left", engine_clean)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm_real_vocab(request, real_vocab_checkpoint, share_loaded_models):
    kw = dict(async_scheduling=request.param, block_size=16, max_model_len=64)
    with LLM(model=str(real_vocab_checkpoint), **kw) as llm:
        yield llm


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_that_accepts_nothing_fails_alone(llm_real_vocab, temperature, engine_clean):  # issue item 4
    llm = llm_real_vocab
    solo = llm.generate(prompt_token_ids=PROMPTS[0], sampling_params=GOOD, use_tqdm=False)[0]
    bad = SamplingParams(
        temperature=temperature, max_tokens=4, so_args={"schema_type": "ebnf", "schema": 'root ::= root "a"'}
    )
    _mixed(llm, bad, solo, "no token left", engine_clean)


def test_bound_token_id_outside_the_vocabulary_is_named(llm_real_vocab, engine_clean):  # issue item 6
    llm = llm_real_vocab
    vocab = llm.engine.vocab_size
    solo = llm.generate(prompt_token_ids=PROMPTS[0], sampling_params=GOOD, use_tqdm=False)[0]
    so = {"schema_type": "regex", "schema": "a", "trigger_token_ids": [5], "bound_token_id": vocab + 5}
    error = _mixed(
        llm, SamplingParams(max_tokens=4, so_args=so), solo, "so_args['bound_token_id']", engine_clean
    )
    assert str(vocab + 5) in error and "trigger_token_ids" not in error
    so = {"schema_type": "regex", "schema": "a", "trigger_token_ids": [5, vocab]}
    _mixed(
        llm,
        SamplingParams(max_tokens=4, so_args=so),
        solo,
        f"so_args['trigger_token_ids'][1]={vocab}",
        engine_clean,
    )
