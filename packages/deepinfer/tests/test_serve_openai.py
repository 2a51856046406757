"""`deepinfer serve` driven by the official `openai` client on loopback: outputs equal the offline engine's
(same seed -> same text), streams add up to the whole, structured outputs hold, a client that goes away
frees its request, the API key is required when set, and bad requests get OpenAI's error shape."""

import asyncio
import json
import re
import time
import urllib.request

import jsonschema
import openai
import pytest
from deepinfer import LLM, AsyncLLM, EngineArgs, LLMEngine, SamplingParams
from deepinfer.reasoning import THINK_END, split_reasoning
from deepinfer.serve import build_app
from deepinfer.serve.background import BackgroundServer

ENGINE = dict(block_size=16, max_model_len=256)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _app(checkpoint, **kwargs):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(checkpoint), **ENGINE))
    api_key = kwargs.pop("api_key", None)
    return build_app(AsyncLLM.from_engine(engine, **kwargs), "micro", api_key=api_key)


@pytest.fixture(scope="module")
def server(real_vocab_checkpoint, share_loaded_models):
    with BackgroundServer(_app(real_vocab_checkpoint)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(real_vocab_checkpoint, share_loaded_models):
    with LLM(model=str(real_vocab_checkpoint), **ENGINE) as llm:
        yield llm


def _metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["micro"]
    assert json.loads(urllib.request.urlopen(server.url + "/health", timeout=30).read()) == {"status": "ok"}


def test_completion_equals_offline_and_same_seed_same_text(client, offline):
    want = offline.generate(
        "The weather",
        SamplingParams(n=2, max_tokens=8, temperature=0.8, top_k=50, seq_seed=7),
        use_tqdm=False,
    )[0]
    kw = dict(
        model="micro",
        prompt="The weather",
        n=2,
        max_tokens=8,
        temperature=0.8,
        seed=7,
        extra_body={"top_k": 50},
    )
    got = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert [c.text for c in got.choices] == [c.text for c in want.outputs]
    assert [c.text for c in again.choices] == [c.text for c in got.choices]
    assert [c.index for c in got.choices] == [0, 1]
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert {c.finish_reason for c in got.choices} == {c.finish_reason for c in want.outputs}
    other = client.completions.create(**(kw | {"seed": 8}))
    assert [c.text for c in other.choices] != [c.text for c in got.choices]


def test_completion_stream_adds_up_with_usage_and_logprobs(client, offline):
    want = offline.generate(
        "Once upon a time",
        SamplingParams(max_tokens=10, seq_seed=3, logprobs=2, stop=["ing"]),
        use_tqdm=False,
    )[0].outputs[0]
    chunks = list(
        client.completions.create(
            model="micro", prompt="Once upon a time", max_tokens=10, seed=3, logprobs=2, stop=["ing"],
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert len(chunks) > 3
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [want.finish_reason]
    logprobs = [lp for c in chunks if c.choices for lp in c.choices[0].logprobs.token_logprobs]
    assert logprobs == pytest.approx(want.token_logprobs)
    assert chunks[-1].usage.completion_tokens == len(want.token_ids) and chunks[-1].choices == []


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    prompt = "The cat sat on the mat"
    want = offline.generate(
        prompt, SamplingParams(max_tokens=5, seq_seed=3, logprobs=2, prompt_logprobs=2), use_tqdm=False
    )[0]
    ids, gen = want.prompt_token_ids, want.outputs[0]
    kw = dict(model="micro", prompt=prompt, max_tokens=5, seed=3, logprobs=2, echo=True)
    got = client.completions.create(**kw).choices[0]
    assert got.text == prompt + gen.text
    lp = got.logprobs
    assert len(lp.tokens) == len(ids) + len(gen.token_ids)
    # the first prompt token has nothing before it; the others are the engine's prompt logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(
        [want.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    )
    assert all(0 < len(top) <= 2 for top in lp.top_logprobs[1 : len(ids)])
    assert lp.token_logprobs[len(ids) :] == pytest.approx(gen.token_logprobs)
    # independently: the last prompt token's logprob as the decode scores it, forced after the rest
    forced = offline.generate(
        {"prompt_token_ids": ids[:-1]},
        SamplingParams(max_tokens=1, logprobs=0, golden_token_ids=[ids[-1]]),
        use_tqdm=False,
    )[0].outputs[0]
    assert forced.token_ids == [ids[-1]]
    assert lp.token_logprobs[len(ids) - 1] == pytest.approx(forced.token_logprobs[0], abs=1e-4)
    # offsets index the returned text (which shows no BOS)
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:], strict=True):
        assert got.text[offset : offset + len(token)] == token
    # streamed: the echo and its logprobs come first, and all of it adds up to the whole
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == got.text
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == lp.text_offset
    streamed = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:])


def test_suffix_is_refused_for_want_of_a_fill_in_the_middle_mode(client):
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle") as e:
        client.completions.create(model="micro", prompt="def f(", suffix="    return x\n", max_tokens=4)
    assert e.value.body["param"] == "suffix"


def test_chat_equals_offline_with_thinking_modes_and_streams(client, offline):
    params = SamplingParams(max_tokens=8, temperature=0.9, seq_seed=21, logprobs=2)
    for kwargs in (None, {"thinking": False}, {"thinking": True}):
        want = offline.chat(MESSAGES, params, chat_template_kwargs=kwargs, use_tqdm=False)[0]
        extra = {} if kwargs is None else {"chat_template_kwargs": kwargs}
        got = client.chat.completions.create(
            model="micro", messages=MESSAGES, max_completion_tokens=8, temperature=0.9, seed=21,
            logprobs=True, top_logprobs=2, extra_body=extra,
        )  # fmt: skip
        # thinking mode: the completion starts in the reasoning; these 8 random tokens never close it
        thinking = bool(kwargs and kwargs["thinking"])
        split = split_reasoning(want.outputs[0].text, thinking)
        message = got.choices[0].message
        assert message.content == split.content
        assert getattr(message, "reasoning_content", None) == split.reasoning
        assert (message.reasoning_content if thinking else message.content) == want.outputs[0].text
        assert message.role == "assistant"
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        lps = got.choices[0].logprobs.content
        assert [e.logprob for e in lps] == pytest.approx(want.outputs[0].token_logprobs)
        assert all(len(e.top_logprobs) == 2 for e in lps)
        stream = client.chat.completions.create(
            model="micro",
            messages=MESSAGES,
            max_tokens=8,
            temperature=0.9,
            seed=21,
            stream=True,
            extra_body=extra,
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(d.content or "" for d in deltas) == (split.content or "")
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (split.reasoning or "")
    tokenizer = offline.get_tokenizer()
    # the thinking modes differ by the one token that opens or closes the reasoning
    lens = [
        client.chat.completions.create(
            model="micro",
            messages=MESSAGES,
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"thinking": t}},
        ).usage.prompt_tokens
        for t in (True, False)
    ]
    base = client.chat.completions.create(model="micro", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    assert lens == [base + 1, base + 1]
    assert tokenizer.token_to_id("<think>") is not None


def test_thinking_output_is_split_into_reasoning_and_content(client, offline):
    """A regex makes the random model close its reasoning; whole message and stream deltas carry the text
    before `</think>` as reasoning_content and the rest as content, exactly the offline text split."""
    so = {"schema_type": "regex", "schema": "[a-z]{2,5} ?</think>[A-Z][a-z]{1,4}[.]"}
    thinking = {"chat_template_kwargs": {"thinking": True}}
    kw = dict(model="micro", messages=MESSAGES, seed=9, n=2, temperature=1.0)
    end_id = offline.get_tokenizer().token_to_id(THINK_END)
    for max_tokens in (40, 3):  # 3: cut short inside the reasoning, which is then all there is
        params = SamplingParams(n=2, max_tokens=max_tokens, temperature=1.0, seq_seed=9, so_args=so)
        want = offline.chat(MESSAGES, params, chat_template_kwargs={"thinking": True}, use_tqdm=False)[0]
        got = client.chat.completions.create(
            **kw, max_tokens=max_tokens, extra_body=thinking | {"so_args": so}
        )
        chunks = list(
            client.chat.completions.create(
                **kw, max_tokens=max_tokens, stream=True, extra_body=thinking | {"so_args": so}
            )
        )
        for choice, out in zip(got.choices, want.outputs, strict=True):
            if max_tokens == 40:
                assert out.finish_reason == "stop" and THINK_END in out.text, out.text
                # spelled over several tokens: the stream held back the marker's first pieces
                assert end_id not in out.token_ids
                reasoning, content = out.text.split(THINK_END, 1)
            else:
                assert out.finish_reason == "length" and THINK_END not in out.text, out.text
                reasoning, content = out.text, None
            message = choice.message
            assert (message.reasoning_content, message.content) == (reasoning, content)
            assert choice.finish_reason == out.finish_reason
            deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == out.index]
            assert deltas[0].role == "assistant"
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
            assert "".join(d.content or "" for d in deltas) == (content or "")
            if max_tokens == 40:  # reasoning streams first, then the answer
                kinds = [bool(getattr(d, "reasoning_content", None)) for d in deltas if d.content or
                         getattr(d, "reasoning_content", None)]  # fmt: skip
                assert kinds[0] and not kinds[-1] and kinds == sorted(kinds, reverse=True)
                assert len(deltas) > 3
    # without thinking mode the same text is all content, the marker included
    plain = (
        client.chat.completions.create(
            model="micro",
            messages=MESSAGES,
            seed=9,
            max_tokens=40,
            temperature=1.0,
            extra_body={"so_args": so},
        )
        .choices[0]
        .message
    )
    assert THINK_END in plain.content and getattr(plain, "reasoning_content", None) is None


def test_structured_outputs(client, offline):
    got = client.completions.create(
        model="micro", prompt="Pick:", max_tokens=6, seed=5,
        extra_body={"so_args": {"schema_type": "regex", "schema": "(yes|no)!"}},
    )  # fmt: skip
    assert re.fullmatch("(yes|no)!", got.choices[0].text) and got.choices[0].finish_reason == "stop"
    # so_args through chat, whitespace bounded so that the random model closes the document
    so = {"schema_type": "json_schema", "schema": SCHEMA, "max_whitespace": 1}
    doc = client.chat.completions.create(
        model="micro", messages=MESSAGES, max_tokens=40, seed=4, extra_body={"so_args": so}
    ).choices[0]
    assert doc.finish_reason == "stop", doc.message.content
    jsonschema.validate(json.loads(doc.message.content), SCHEMA)
    # OpenAI's response_format is exactly the engine's json_schema / json_object so_args
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for response_format, so_args in (
        (fmt, {"schema_type": "json_schema", "schema": SCHEMA}),
        ({"type": "json_object"}, {"schema_type": "json_object"}),
    ):
        want = offline.chat(
            MESSAGES, SamplingParams(max_tokens=12, seq_seed=4, so_args=so_args), use_tqdm=False
        )
        got = client.chat.completions.create(
            model="micro", messages=MESSAGES, max_tokens=12, seed=4, response_format=response_format
        )
        assert got.choices[0].message.content == want[0].outputs[0].text
        assert got.choices[0].message.content.lstrip().startswith("{")
    with pytest.raises(openai.BadRequestError, match="response_format or so_args"):
        client.chat.completions.create(
            model="micro", messages=MESSAGES, response_format={"type": "json_object"},
            extra_body={"so_args": {"schema_type": "regex", "schema": "a"}},
        )  # fmt: skip


def _wait_idle(server, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(server)
        idle = m["deepinfer_num_requests_running"] == 0 and m["deepinfer_num_requests_waiting"] == 0
        if (idle and m["deepinfer_kv_cache_usage_ratio"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_client_disconnect_aborts_and_frees_blocks(client, server):
    long = dict(model="micro", max_tokens=200, extra_body={"ignore_eos": True})
    before = _metrics(server)["deepinfer_generation_tokens_total"]
    stream = client.completions.create(prompt="Keep going", stream=True, **long)
    for chunk in stream:
        if chunk.choices[0].text:
            break
    stream.close()
    m = _wait_idle(server)
    assert m["deepinfer_num_requests_running"] == 0 and m["deepinfer_kv_cache_usage_ratio"] == 0
    assert m["deepinfer_generation_tokens_total"] - before < 200  # stopped, not run to the end
    before = m["deepinfer_generation_tokens_total"]
    # and a non-streaming request whose client gives up
    quick = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        quick.completions.create(prompt="Keep going on", **long)
    m = _wait_idle(server)
    assert m["deepinfer_num_requests_running"] == 0 and m["deepinfer_kv_cache_usage_ratio"] == 0
    assert m["deepinfer_generation_tokens_total"] - before < 200
    assert m["deepinfer_request_success_total"] >= 1


def test_errors_have_openai_shape_and_leave_other_streams_alone(client, offline):
    want = offline.generate("Steady", SamplingParams(max_tokens=12, seq_seed=1), use_tqdm=False)[0].outputs[0]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=120)

        async def stream_text():
            s = await aclient.completions.create(
                model="micro", prompt="Steady", max_tokens=12, seed=1, stream=True
            )
            return "".join([c.choices[0].text async for c in s if c.choices])

        async def bad(**kw):
            with pytest.raises(openai.APIStatusError) as e:
                await aclient.completions.create(**({"model": "micro", "prompt": "x"} | kw))
            return e.value

        task = asyncio.ensure_future(stream_text())
        errors = [
            await bad(temperature=-1),
            await bad(model="nope"),
            await bad(prompt="word " * 400),
            await bad(max_tokens=300),
            await bad(extra_body={"foo": 1}),
            await bad(logit_bias={"999999": 1}),
            await bad(prompt=[0, 999999]),
            await bad(logprobs=21),
            await bad(extra_body={"so_args": {"schema_type": "regex", "schema": "(?=x)y"}}),
        ]
        return await task, errors

    text, errors = asyncio.run(run())
    assert text == want.text
    expect = [
        (400, "temperature", None),
        (404, "model", "model_not_found"),
        (400, "prompt", "context_length_exceeded"),
        (400, "max_tokens", "context_length_exceeded"),
        (400, "foo", None),
        (400, "logit_bias", None),
        (400, "prompt", None),
        (400, "logprobs", None),
        (400, "so_args", None),
    ]
    for err, (status, param, code) in zip(errors, expect, strict=True):
        assert err.status_code == status, err
        body = err.body
        assert body["param"] == param and body["code"] == code and body["type"] == "invalid_request_error", (
            body
        )
        assert body["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="micro", messages=MESSAGES, max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="micro", input="x")


def test_metrics_count_what_ran(client, server):
    client.completions.create(model="micro", prompt="Count me", max_tokens=4, seed=2)
    m = _metrics(server)
    assert m["deepinfer_time_to_first_token_seconds_count"] >= 1
    assert m["deepinfer_inter_token_latency_seconds_count"] >= 3
    assert m["deepinfer_e2e_request_latency_seconds_count"] >= 1
    assert m["deepinfer_generation_tokens_total"] >= 4 and m["deepinfer_prompt_tokens_total"] >= 2
    for name in ("deepinfer_prefix_cache_hit_rate", "deepinfer_generation_tokens_per_second"):
        assert name in m


def test_api_key_required_when_set(real_vocab_checkpoint, share_loaded_models):
    with BackgroundServer(_app(real_vocab_checkpoint, api_key="s3cret")) as s:
        for key in ("wrong", ""):
            c = openai.OpenAI(base_url=s.url + "/v1", api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
        req = urllib.request.Request(s.url + "/v1/models")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="micro", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        assert urllib.request.urlopen(s.url + "/health", timeout=30).status == 200


def test_queue_full_is_503_and_the_admitted_complete(real_vocab_checkpoint, share_loaded_models):
    with BackgroundServer(_app(real_vocab_checkpoint, max_waiting_requests=1)) as s:

        async def run():
            c = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)

            async def one(i):
                try:
                    r = await c.completions.create(model="micro", prompt=f"Item {i}", max_tokens=3, seed=i)
                    return r.usage.completion_tokens
                except openai.APIStatusError as e:
                    return e.status_code, e.body["code"]

            return await asyncio.gather(*(one(i) for i in range(8)))

        results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, tuple)]
    assert refused and all(r == (503, "engine_overloaded") for r in refused)
    assert all(r == 3 for r in results if not isinstance(r, tuple))
