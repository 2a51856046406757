"""`SamplingParams.prompt_logprobs` from the prefill's logits, against a float64 log_softmax of the
model's logits from a direct (stateless) forward over the prompt."""

import pytest
import torch
from deepinfer import LLM, SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

PROMPT = [0, *range(20, 60)]  # 41 tokens: three chunks under max_num_batched_tokens=16


def _check(out, model, k):
    logits = model.forward(torch.tensor(out.prompt_token_ids))
    logits = getattr(logits, "logits", logits).double()  # the V4.1 forward returns more than logits
    ref = torch.log_softmax(logits, -1)
    got = out.prompt_logprobs
    assert len(got) == len(out.prompt_token_ids) and got[0] is None
    for p in range(1, len(got)):
        token, row = out.prompt_token_ids[p], ref[p - 1]
        entry = got[p]
        assert next(iter(entry)) == token
        top = torch.argsort(row, descending=True, stable=True)[:k].tolist()
        assert set(entry) == {token, *top}, p
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-5)
        for place, t in enumerate(top, start=1):
            assert entry[t].rank == place
        if token not in top:
            assert entry[token].rank == max(int((row > row[token]).sum()) + 1, k + 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_match_a_direct_forward(micro_checkpoint, async_scheduling, k):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)
    with LLM(
        model=str(micro_checkpoint),
        block_size=16,
        max_model_len=64,
        max_num_batched_tokens=16,  # the prompt prefills in three chunks
        async_scheduling=async_scheduling,
    ) as llm:
        plain = llm.generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False
        )
        outs = llm.generate([PROMPT, PROMPT[:9]], params, use_tqdm=False)
        # asked again: the prompt's blocks are in the prefix cache, yet every row is scored anew
        again = llm.generate([PROMPT], params, use_tqdm=False)[0]
        model = llm.engine.model
    assert plain[0].prompt_logprobs is None
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids  # sampling is unchanged
    for out in (*outs, again):
        _check(out, model, k)
    assert again.prompt_logprobs == outs[0].prompt_logprobs


def test_prompt_logprobs_with_n_samples_and_the_reference_boolean(micro_checkpoint):
    params = SamplingParams(temperature=1.0, n=3, max_tokens=2, seq_seed=4, prompt_logprobs=True)
    assert params.prompt_logprobs == 0
    with LLM(model=str(micro_checkpoint), block_size=16, max_model_len=64) as llm:
        out = llm.generate([PROMPT[:20]], params, use_tqdm=False)[0]
        _check(out, llm.engine.model, 0)
        assert len(out.outputs) == 3
        record = out.to_json()
    assert record["prompt_logprobs"][0] is None and set(record["prompt_logprobs"][1]) == {str(PROMPT[1])}


def test_prompt_logprobs_with_speculative_decoding(tmp_path_factory):
    path = make_v41_checkpoint(tmp_path_factory.mktemp("v41-prompt-lp"), seed=0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    engine = LLMEngine(EngineArgs(model=str(path), block_size=16, max_model_len=48), num_speculative_tokens=3)
    engine.add_request("a", None, params, prompt_token_ids=PROMPT[:20])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    engine.close()
    assert engine.num_speculative_tokens == 3 and len(outs[0].outputs[0].token_ids) == 6
    _check(outs[0], engine.model, 1)
