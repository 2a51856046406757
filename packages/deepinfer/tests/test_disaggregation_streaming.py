"""Streaming through the disaggregated front (engine/disaggregated.py, engine/disagg_process.py): the decode
engine reports each streamed request's output after every step that gave it tokens, as a data-parallel
rank does, so an `AsyncLLM` (and `deepinfer serve --disaggregation shm`) delivers tokens as they are made.

Reference: a NORMAL engine on the same checkpoint (the split engines give exactly its tokens). A stream
must grow over several outputs, never take text back, and end in exactly the NORMAL engine's output; a
decode engine killed mid-stream ends the streams of its own requests with an error, and a request the
front held for it meanwhile comes out of the restarted engine whole.
"""

import asyncio
import os
import signal

import openai
import pytest
from deepinfer import LLM, AsyncLLM, SamplingParams
from deepinfer.serve.background import BackgroundServer
from deepinfer.serve.cli import add_serve_args, make_app

pytestmark = pytest.mark.slow

BLOCK = 4
FRONT = dict(
    block_size=BLOCK, max_model_len=64, num_kv_blocks=64, max_num_seqs=4, distributed_startup_timeout=300
)
PROMPTS = [list(range(1, 10)), [5], list(range(40, 53))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(temperature=1.0, top_k=50, max_tokens=24, ignore_eos=True, seed=7)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True)  # front's seed stream


def check_stream(outs, want) -> None:
    """`outs`: one request's stream; each output extends the one before; the last is `want`'s."""
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(outs) > 1, want.request_id  # not all at the end
    last = outs[-1]
    assert last.error is None and want.error is None, (last.error, want.error)
    for got, ref in zip(last.outputs, want.outputs, strict=True):
        assert got.token_ids == ref.token_ids
        assert got.logprobs == ref.logprobs
        assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason)
    for index in range(len(want.outputs)):
        deltas, seen_text, seen_ids = [], "", []
        for out in outs:
            now = out.outputs[index]
            assert now.token_ids[: len(seen_ids)] == seen_ids
            assert now.text.startswith(seen_text)
            deltas.append(now.text[len(seen_text) :])
            seen_text, seen_ids = now.text, list(now.token_ids)
        assert "".join(deltas) == want.outputs[index].text


async def collect(llm, ids, params, request_id=None):
    return [out async for out in llm.generate(None, params, request_id, prompt_token_ids=ids)]


def test_async_llm_over_a_disaggregated_front_streams_tokens(micro_checkpoint):
    params = [GREEDY, SEEDED, SAMPLED]
    with LLM(str(micro_checkpoint), async_scheduling=False, **FRONT) as llm:
        want = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)

    async def run():
        async with AsyncLLM(str(micro_checkpoint), disaggregation="shm", **FRONT) as llm:
            assert llm.engine.stream_outputs
            # one at a time: the sampled request draws its seeds from the front's stream in this order
            streams = []
            for ids, p in zip(PROMPTS, params):
                streams.append(asyncio.ensure_future(collect(llm, ids, p)))
                await asyncio.sleep(0)
            streams = await asyncio.gather(*streams)
            assert llm.engine.partial_outputs == {}  # the finished outputs replaced them
            return streams

    for outs, w in zip(asyncio.run(run()), want, strict=True):
        check_stream(outs, w)


def test_a_decode_engine_killed_mid_stream_fails_only_its_requests(micro_checkpoint):
    """128 blocks of 4: one 9 + 400-token request at its longest fills the decode engine, so the second
    is held at the front. Killing the decode engine ends the first stream with an error naming it; the
    held request goes to the restarted engine, once, and streams the NORMAL engine's output."""
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    prompts = [list(range(1, 10)), list(range(20, 29))]
    more = FRONT | {"num_kv_blocks": 128, "max_model_len": 512}
    with LLM(str(micro_checkpoint), async_scheduling=False, **more) as llm:
        want = llm.generate(prompt_token_ids=prompts[1:], sampling_params=long, use_tqdm=False)[0]

    async def run():
        async with AsyncLLM(str(micro_checkpoint), disaggregation="shm", **more) as llm:
            engine = llm.engine
            victim = await llm.add_request(None, long, "victim", prompt_token_ids=prompts[0])
            held = asyncio.ensure_future(collect(llm, prompts[1], long, "held"))
            seen = []
            async for out in victim:
                seen.append(out)
                if len(seen) == 2:
                    assert engine.stage_of("victim") == "decode"
                    for _ in range(600):  # the second request's record reaches the front
                        if engine.stage_of("held") == "held":
                            break
                        await asyncio.sleep(0.1)
                    assert engine.stage_of("held") == "held"
                    os.kill(engine.pids()["completion"], signal.SIGKILL)
            return seen, await held, dict(engine.restarts)

    seen, held_outs, restarts = asyncio.run(run())
    assert 0 < len(seen[1].outputs[0].token_ids) < 400
    last = seen[-1]
    assert last.finished and "the completion engine" in last.error and "exited with code -9" in last.error
    assert restarts == {"prompt": 0, "completion": 1}
    check_stream(held_outs, want)


@pytest.fixture(scope="module")
def server(real_vocab_checkpoint):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(
        ["--model", str(real_vocab_checkpoint), "--disaggregation", "shm", "--block-size", "16"]
        + ["--max-model-len", "256", "--distributed-startup-timeout", "300"]
    )
    with BackgroundServer(make_app(args), start_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"]
)
def test_serve_disaggregated_streams_deltas_that_add_up_to_the_normal_text(
    client, real_vocab_checkpoint, sampling
):
    model = client.models.list().data[0].id
    kw = (
        dict(model=model, prompt="The weather today", max_tokens=40, extra_body={"ignore_eos": True})
        | sampling
    )
    with LLM(str(real_vocab_checkpoint), block_size=16, max_model_len=256) as llm:
        want = llm.generate(
            "The weather today",
            SamplingParams(
                max_tokens=40,
                ignore_eos=True,
                temperature=sampling["temperature"],
                seq_seed=sampling.get("seed"),
            ),
            use_tqdm=False,
        )[0].outputs[0]
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    deltas = [c.text for c in chunks if c.text]
    assert len(deltas) > 1
    assert "".join(deltas) == whole.text == want.text
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"] == [want.finish_reason]
