"""A request that reaches a row with no legal token fails alone, with the plain sampler's reason, while
drafts are on (the default for a checkpoint with DSpark draft blocks), greedy and sampled alike and in
both loops: every token banned by its stop ids before min_tokens, a grammar that accepts nothing, and a
row that allows nothing after accepted drafts (a grammar that is complete while EOS is still banned; bad
words that leave no token, where the drafter has none either). The failed request emits what it emits
with drafts off, the others of the batch what they emit alone, and every block is free after.
"""

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model import EMPTY_ROW_MESSAGE
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

VOCAB = 256  # the tiny V4.1's vocabulary
PROMPTS = [[0, 40, 77, 91, 12, 200, 5], [0, 7, 7, 8, 9], [0, 150, 33, 98, 140, 21, 66]]
GOOD = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seq_seed=5),
]
A, B = 67, 68  # the tokens "a" and "b" of the checkpoint's tokenizer
NUL = 191  # the token "\x00": "\x00\x00\x00" is three of it


def _bad(case: str, temperature: float) -> SamplingParams:
    kw = dict(temperature=temperature, max_tokens=6, seq_seed=3)
    if case == "all_banned":  # every token is a stop token, banned before min_tokens
        return SamplingParams(min_tokens=3, stop_token_ids=list(range(VOCAB)), **kw)
    if case == "grammar_accepts_nothing":
        return SamplingParams(so_args={"schema_type": "ebnf", "schema": 'root ::= root "a"'}, **kw)
    if case == "grammar_complete_before_min_tokens":  # "a", "b", then only EOS, banned: no token
        # (the bias makes the drafter, which sees no grammar, draft "b": the row after it has no token)
        return SamplingParams(
            so_args={"schema_type": "regex", "schema": "ab"}, min_tokens=3, logit_bias={B: 30.0}, **kw
        )
    if case == "bad_words_leave_nothing":  # NUL, NUL, then NUL is banned and nothing else is allowed
        return SamplingParams(allowed_token_ids=[NUL], bad_words=["\x00\x00\x00"], **kw)
    raise AssertionError(case)


CASES = {
    "all_banned": [],
    "grammar_accepts_nothing": [],
    "grammar_complete_before_min_tokens": [A, B],
    "bad_words_leave_nothing": [NUL, NUL],
}


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-no-token"), seed=0)


@pytest.fixture(scope="module", params=["sync", "async"])
def llm(request, v41):
    with pytest.MonkeyPatch.context() as m:
        m.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
        llm = LLM(model=str(v41), block_size=16, max_model_len=48, async_scheduling=request.param == "async")
    assert llm.engine.num_speculative_tokens == 5  # drafts on by default
    llm.solo = [
        llm.generate(prompt_token_ids=p, sampling_params=g, use_tqdm=False)[0]
        for p, g in zip([PROMPTS[0], PROMPTS[2]], GOOD)
    ]
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def plain(v41):
    """The same engine with drafts off: what a failing request emits and says there."""
    llm = LLM.from_engine(
        LLMEngine(EngineArgs(model=str(v41), block_size=16, max_model_len=48), num_speculative_tokens=0)
    )
    yield llm
    llm.engine.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_row_with_no_token_fails_its_request_alone(llm, plain, case, temperature, engine_clean):
    bad = _bad(case, temperature)
    drafted_before = llm.engine.spec_stats()["verified"]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[GOOD[0], bad, GOOD[1]], use_tqdm=False)
    for out, solo in zip([outs[0], outs[2]], llm.solo):
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == solo.outputs[0].token_ids
    failed = outs[1]
    assert failed.error == f"sampling failed: {EMPTY_ROW_MESSAGE}", failed.error
    emitted = failed.outputs[0].token_ids if failed.outputs else []
    assert emitted == CASES[case]
    assert llm.engine.spec_stats()["verified"] > drafted_before  # the batch really verified drafts
    if emitted:  # it reached the row with no token through an accepted draft
        assert failed.metrics.num_accepted_draft_tokens >= 1
    engine_clean(llm.engine)
    reference = plain.generate(prompt_token_ids=PROMPTS[1], sampling_params=bad, use_tqdm=False)[0]
    assert reference.error == failed.error
    assert (reference.outputs[0].token_ids if reference.outputs else []) == emitted
    again = llm.generate(prompt_token_ids=PROMPTS[0], sampling_params=GOOD[0], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == llm.solo[0].outputs[0].token_ids
    engine_clean(llm.engine)
