"""vLLM's prompt forms in `LLM.generate`, and invalid requests raising by default."""

import pytest
from deepinfer import LLM, SamplingParams

IDS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(real_vocab_checkpoint):
    with LLM(model=str(real_vocab_checkpoint), block_size=16, max_model_len=128) as llm:
        yield llm


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_every_prompt_form_runs_the_same_tokens(llm):
    want = _tokens(llm.generate(prompt_token_ids=IDS, sampling_params=GREEDY, use_tqdm=False))
    assert all(len(t) == 3 for t in want)
    for form in (
        IDS,
        [{"prompt_token_ids": ids} for ids in IDS],
        [{"prompt_token_ids": IDS[0]}, IDS[1]],
    ):
        outs = llm.generate(form, GREEDY, use_tqdm=False)
        assert _tokens(outs) == want
        assert [o.prompt_token_ids for o in outs] == IDS
    # one token prompt on its own: a flat id list is one prompt, not a batch of one-token prompts
    assert _tokens(llm.generate(IDS[0], GREEDY, use_tqdm=False)) == want[:1]
    assert _tokens(llm.generate({"prompt_token_ids": IDS[0]}, GREEDY, use_tqdm=False)) == want[:1]


def test_text_forms_and_dict_with_both_keys(llm):
    text = "Hello there"
    want = llm.generate(text, GREEDY, use_tqdm=False)[0]
    for form in ({"prompt": text}, [{"prompt": text}], [text]):
        got = llm.generate(form, GREEDY, use_tqdm=False)[0]
        assert got.prompt == text and got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # both keys: the ids run, the text is what the output reports as its prompt
    got = llm.generate({"prompt": "label", "prompt_token_ids": IDS[1]}, GREEDY, use_tqdm=False)[0]
    assert got.prompt == "label" and got.prompt_token_ids == IDS[1]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_token_ids": "1 2 3"}, r"prompts\[1\]\['prompt_token_ids'\] must be a list of int"),
        ({"prompt": 5}, r"prompts\[1\]\['prompt'\] must be a str"),
        ({"text": "hi"}, r"prompts\[1\] has unsupported keys \['text'\]"),
        ({}, r"prompts\[1\] must have a 'prompt'"),
        ([1, "2"], r"prompts\[1\] must be a list of int token ids"),
        (3.5, r"prompts\[1\] must be a str, a list of token ids"),
    ],
)
def test_malformed_prompt_raises_naming_it(llm, bad, message):
    free = llm.engine.scheduler_stats()["num_free_blocks"]
    with pytest.raises(ValueError, match=message):
        llm.generate([IDS[0], bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler_stats()["num_free_blocks"] == free
    outs = llm.generate([IDS[0], bad], GREEDY, use_tqdm=False, raise_on_error=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 3
    assert outs[1].error is not None and outs[1].outputs == []


def test_invalid_requests_raise_by_default_and_run_nothing(llm):
    vocab = llm.engine.vocab_size
    before = llm.engine.stats.prompt_tokens
    with pytest.raises(
        ValueError, match=rf"request 1: prompt_token_ids\[0\]={vocab + 1}: must be in \[0, {vocab}\)"
    ):
        llm.generate([IDS[0], [vocab + 1]], GREEDY, use_tqdm=False)
    # a list of integers is a token prompt; a bool in it is named by its position, in every form
    for form in ([IDS[0], [0, True]], [IDS[0], {"prompt_token_ids": [0, True]}]):
        with pytest.raises(ValueError, match=r"request 1: prompt_token_ids\[1\]=True: must be an integer"):
            llm.generate(form, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="request 0: .*top_p"):
        llm.generate(IDS[:1], {"top_p": 2.0}, use_tqdm=False)
    with pytest.raises(ValueError, match="request 0: .*empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    assert llm.engine.stats.prompt_tokens == before  # no request of these calls was admitted


def test_bad_so_args_raise_and_leave_nothing_queued(llm):
    bad = SamplingParams(max_tokens=4, so_args={"schema_type": "regex", "schema": "(?=lookahead)x"})
    free = llm.engine.scheduler_stats()["num_free_blocks"]
    for raise_on_error in (True, None):  # explicit, and the default
        kwargs = {} if raise_on_error is None else {"raise_on_error": True}
        with pytest.raises(ValueError, match="request 1: .*look"):
            llm.generate(IDS, [GREEDY, bad], use_tqdm=False, **kwargs)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler_stats()["num_free_blocks"] == free
    # the engine is still usable, and per-request errors remain available
    outs = llm.generate(IDS, [GREEDY, bad], use_tqdm=False, raise_on_error=False)
    assert len(outs[0].outputs[0].token_ids) == 3 and "look" in outs[1].error.lower()
