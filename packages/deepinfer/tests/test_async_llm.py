"""`AsyncLLM`: streaming outputs equal the offline engine's, arrive token by token, never take text back,
and a request can be aborted (by call or by leaving its loop) without touching the others."""

import asyncio

import pytest
from deepinfer import LLM, AsyncLLM, EngineArgs, LLMEngine, QueueFullError, SamplingParams
from deepinfer.outputs import CompletionOutput
from deepinfer.streaming import visible_text

PROMPTS = [[0, 40, 77, 91, 12, 300, 5], [0, 7, 7, 8, 9], [0, 450, 33, 98, 140, 21, 66, 71, 250]]
ENGINE = dict(block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def offline(micro_checkpoint, share_loaded_models):
    with LLM(model=str(micro_checkpoint), **ENGINE) as llm:
        yield llm


@pytest.fixture
def make_async(micro_checkpoint, share_loaded_models):
    """A fresh AsyncLLM over a fresh engine (the model is shared): its loop lives in the test's event loop."""

    def make(**kwargs):
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(micro_checkpoint), **ENGINE))
        return AsyncLLM.from_engine(engine, **kwargs)

    return make


def _sampled(i: int, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=0.95, max_tokens=12, seq_seed=500 + i, n=2, ignore_eos=True, **kw
    )


async def _collect(llm: AsyncLLM, ids, params, request_id=None):
    return [
        out async for out in llm.generate(prompt_token_ids=ids, sampling_params=params, request_id=request_id)
    ]


def test_streams_equal_offline_and_grow_token_by_token(offline, make_async, engine_clean):
    want = offline.generate(
        prompt_token_ids=PROMPTS, sampling_params=[_sampled(i) for i in range(3)], use_tqdm=False
    )

    async def run():
        async with make_async() as llm:
            streams = await asyncio.gather(
                *(_collect(llm, ids, _sampled(i)) for i, ids in enumerate(PROMPTS))
            )
            engine_clean(llm.engine)
            return streams

    streams = asyncio.run(run())
    for w, outs in zip(want, streams):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert len(outs) > 3  # tokens arrived over several steps, not all at the end
        for got, ref in zip(final.outputs, w.outputs, strict=True):
            assert got.token_ids == ref.token_ids and got.text == ref.text
            assert got.finish_reason == ref.finish_reason == "length"
        for earlier, later in zip(outs, outs[1:]):
            for a, b in zip(earlier.outputs, later.outputs):
                assert b.token_ids[: len(a.token_ids)] == a.token_ids
                assert b.text.startswith(a.text)
        assert final.metrics.ttft is not None and final.metrics.num_output_tokens == 24


def test_stream_with_stop_string_never_takes_text_back(offline, make_async):
    free = offline.generate(
        prompt_token_ids=PROMPTS[2], sampling_params=_sampled(7, skip_special_tokens=True), use_tqdm=False
    )[0].outputs[0]
    text = free.text
    assert len(text) > 12
    stop = text[
        len(text) // 2 : len(text) // 2 + 6
    ]  # several tokens long: seen partially before it completes
    params = SamplingParams(
        temperature=0.9, top_p=0.95, max_tokens=12, seq_seed=507, ignore_eos=True, stop=[stop]
    )
    want = offline.generate(prompt_token_ids=PROMPTS[2], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop"

    async def run():
        async with make_async() as llm:
            return await _collect(llm, PROMPTS[2], params)

    outs = asyncio.run(run())
    assert outs[-1].outputs[0].text == want.text
    for out in outs:
        assert want.text.startswith(out.outputs[0].text), (out.outputs[0].text, want.text)


def test_visible_text_holds_back_a_possible_stop_prefix():
    out = CompletionOutput(index=0, text="hello wor")
    assert visible_text(out, ["world", "ab"]) == "hello"
    assert visible_text(out, []) == "hello wor"
    out.finish_reason = "length"
    assert visible_text(out, ["world"]) == "hello wor"
    assert visible_text(CompletionOutput(index=0, text="ab"), ["xyz12"]) == ""


def test_abort_and_leaving_the_loop_free_the_request_others_unaffected(offline, make_async, engine_clean):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    want = offline.generate(prompt_token_ids=PROMPTS[1], sampling_params=_sampled(1), use_tqdm=False)[0]

    async def run():
        async with make_async() as llm:
            other = asyncio.ensure_future(_collect(llm, PROMPTS[1], _sampled(1)))
            stream = await llm.add_request(prompt_token_ids=PROMPTS[0], sampling_params=long, request_id="a")
            first = await anext(stream)
            assert not first.finished
            assert llm.abort("a")
            outs = [first] + [o async for o in stream]
            # leaving an `async for` early aborts the request too
            async for out in llm.generate(prompt_token_ids=PROMPTS[2], sampling_params=long, request_id="b"):
                if out.outputs[0].token_ids:
                    break
            got = await other
            while llm.engine.has_unfinished_requests():  # the loop settles "b"'s abort in its next step
                await asyncio.sleep(0.01)
            engine_clean(llm.engine)
            assert not llm.abort("a")  # finished requests are unknown
            return outs, got

    outs, got = asyncio.run(run())
    final = outs[-1].outputs[0]
    assert final.finish_reason == "abort" and len(final.token_ids) < 200
    assert [o.token_ids for o in got[-1].outputs] == [o.token_ids for o in want.outputs]


def test_bad_request_raises_naming_the_field_and_others_run(offline, make_async):
    async def run():
        async with make_async() as llm:
            good = asyncio.ensure_future(_collect(llm, PROMPTS[0], _sampled(0)))
            with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]=100000: must be in \[0, 512\)"):
                await llm.add_request(prompt_token_ids=[0, 100000], sampling_params=SamplingParams())
            with pytest.raises(ValueError, match="top_p"):
                await llm.add_request(prompt_token_ids=[0, 1], sampling_params={"top_p": 2.0})
            with pytest.raises(ValueError, match="logit_bias"):  # refused by the engine itself, in the loop
                await llm.add_request(prompt_token_ids=[0, 1], sampling_params={"logit_bias": {9999: 1.0}})
            return await good

    got = asyncio.run(run())
    want = offline.generate(prompt_token_ids=PROMPTS[0], sampling_params=_sampled(0), use_tqdm=False)[0]
    assert [o.token_ids for o in got[-1].outputs] == [o.token_ids for o in want.outputs]


def test_queue_full_past_max_waiting_requests(make_async):
    async def run():
        async with make_async(max_waiting_requests=2) as llm:
            p = SamplingParams(temperature=0.0, max_tokens=2)
            adds = [
                asyncio.ensure_future(llm.add_request(prompt_token_ids=ids, sampling_params=p))
                for ids in PROMPTS[:2]
            ]
            await asyncio.sleep(0)  # both queued, no step has run yet
            assert llm.num_waiting == 2
            with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
                await llm.add_request(prompt_token_ids=PROMPTS[2], sampling_params=p)
            for s in await asyncio.gather(*adds):
                assert [o async for o in s][-1].finished
            assert llm.num_waiting == 0
            await llm.add_request(prompt_token_ids=PROMPTS[2], sampling_params=p)  # room again

    asyncio.run(run())
    with pytest.raises(ValueError, match="max_waiting_requests"):
        make_async(max_waiting_requests=0)
