"""`EngineArgs.stop_preempted_request`: a sequence preempted for want of KV blocks finishes with what it
has generated (finish_reason "insufficient_system_resource", the reference's name) instead of being
recomputed.

Reference: each request run alone, in an engine of the same cache size (one sequence fits, so it is
never preempted). With the flag on, the preempted requests stop early with a prefix of their solo
output and the others equal theirs; with it off, every request equals its solo output. Either way
the engine ends with every block free.
"""

import re

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.engine_args import EngineArgs

PROMPTS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9], [0, 450, 33, 98, 140, 21, 66, 71, 250]]
PREEMPTED = "insufficient_system_resource"
# 5 blocks of 16 tokens cannot hold three sequences growing to 29-33 tokens (2-3 blocks each)
SMALL_CACHE = dict(block_size=16, max_model_len=64, num_kv_blocks=5)


def _solo(llm, prompts, params):
    return [
        llm.generate(prompt_token_ids=[p], sampling_params=[sp], use_tqdm=False)[0].outputs[0]
        for p, sp in zip(prompts, params)
    ]


def _check_all_blocks_free(llm):
    stats = llm.engine.scheduler_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] == SMALL_CACHE["num_kv_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def _run(checkpoint, prompts, params, use_async, stop_preempted):
    with LLM(
        model=str(checkpoint),
        async_scheduling=use_async,
        stop_preempted_request=stop_preempted,
        **SMALL_CACHE,
    ) as llm:
        solo = _solo(llm, prompts, params)
        assert llm.engine.scheduler_stats()["num_preemptions"] == 0  # alone, a request is never preempted
        together = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        preemptions = llm.engine.scheduler_stats()["num_preemptions"]
        _check_all_blocks_free(llm)
        # the engine goes on serving: the next batch equals the solo outputs again
        again = _solo(llm, prompts[:1], params[:1])
        assert again[0].token_ids == solo[0].token_ids
    return solo, [o.outputs[0] for o in together], preemptions


def _check(solo, got, preemptions, stop_preempted):
    assert preemptions > 0
    stopped = [i for i, o in enumerate(got) if o.finish_reason == PREEMPTED]
    if not stop_preempted:
        assert not stopped
        assert [o.token_ids for o in got] == [o.token_ids for o in solo]
        return
    assert 0 < len(stopped) <= preemptions
    for i, (g, s) in enumerate(zip(got, solo)):
        if i in stopped:
            assert len(g.token_ids) < len(s.token_ids), i
            assert g.token_ids == s.token_ids[: len(g.token_ids)], i
            assert s.text.startswith(g.text), (g.text, s.text)
        else:
            assert (g.token_ids, g.finish_reason, g.text) == (s.token_ids, s.finish_reason, s.text), i


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("stop_preempted", [False, True])
def test_preempted_requests_finish_early_with_a_prefix_of_their_solo_output(
    micro_checkpoint, use_async, stop_preempted
):
    params = [
        SamplingParams(temperature=0.7, max_tokens=24, seq_seed=11 + i, ignore_eos=True, logprobs=1)
        for i in range(3)
    ]
    solo, got, preemptions = _run(micro_checkpoint, PROMPTS, params, use_async, stop_preempted)
    _check(solo, got, preemptions, stop_preempted)
    for g, s in zip(got, solo):  # logprobs follow the tokens
        assert g.logprobs == s.logprobs[: len(g.logprobs)]


@pytest.mark.parametrize("stop_preempted", [False, True])
def test_structured_requests_are_recomputed_unless_the_flag_says_otherwise(
    real_vocab_checkpoint, stop_preempted
):
    # Unlike the reference, a grammar survives recompute here (its matcher keeps the accepted tokens
    # and the recompute re-prefills prompt + output), so a preempted structured request is recomputed
    # like any other and only the flag finishes it early.
    regex = "[a-z ]{40,200}"
    params = [
        SamplingParams(
            temperature=0.9, max_tokens=24, seq_seed=3 + i, so_args={"schema_type": "regex", "schema": regex}
        )
        for i in range(3)
    ]
    solo, got, preemptions = _run(real_vocab_checkpoint, PROMPTS, params, True, stop_preempted)
    _check(solo, got, preemptions, stop_preempted)
    for o in got:
        assert re.fullmatch("[a-z ]*", o.text), o.text


def test_the_flag_must_be_a_bool():
    with pytest.raises(ValueError, match="stop_preempted_request must be a bool"):
        EngineArgs(stop_preempted_request="yes", device="cpu")
