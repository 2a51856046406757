"""Tool calling through `deepinfer serve` with the official `openai` client: a forced call (tool_choice
required / a named function) is a valid call of an allowed tool even from the random-weights model, whole
and streamed alike and equal to the offline engine's; "auto" reads calls the model writes and leaves other
text as content, "none" reads none, and without parallel calls "auto" keeps the first call only; the
history's tool calls and tool results render as `LLM.chat` renders them, their ids pairing results with
calls; bad tool definitions and choices are 400s naming the field."""

import json

import jsonschema
import openai
import pytest
from deepinfer import LLM, AsyncLLM, EngineArgs, LLMEngine, SamplingParams, parse_tool_calls
from deepinfer.serve import build_app
from deepinfer.serve.background import BackgroundServer
from deepinfer.serve.protocol import ChatCompletionRequest
from deepinfer.serve.tools import calls_grammar, plan_tools
from deepinfer.tool_calls import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END

ENGINE = dict(block_size=16, max_model_len=512)
MESSAGES = [{"role": "user", "content": "Weather in Paris for three days, and the time?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"utc": {"type": "boolean"}},
    "required": ["utc"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "A forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}


@pytest.fixture(scope="module")
def client(real_vocab_checkpoint, share_loaded_models):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(real_vocab_checkpoint), **ENGINE))
    with BackgroundServer(build_app(AsyncLLM.from_engine(engine), "micro")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline(real_vocab_checkpoint, share_loaded_models):
    with LLM(model=str(real_vocab_checkpoint), **ENGINE) as llm:
        yield llm


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(chunks) -> tuple[str, list[tuple[str, str]], str]:
    """(content, calls, finish reason) put together from a chat stream the way clients do."""
    content, calls, ids, finish = "", [], [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: its id, then its name, before any argument
                assert d.index == len(calls) and d.function.name and d.type == "function"
                ids.append(d.id)
                calls.append([d.function.name, ""])
            assert d.index == len(calls) - 1
            calls[d.index][1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    assert len(set(ids)) == len(ids)
    return content, [tuple(c) for c in calls], finish


def test_a_named_tool_choice_forces_one_valid_call_equal_to_the_offline_engine(client, offline):
    kw = dict(
        model="micro",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "weather"}},
        parallel_tool_calls=False,
        max_tokens=300,
        seed=11,
        temperature=1.0,
    )
    got = client.chat.completions.create(**kw).choices[0]
    assert got.finish_reason == "tool_calls", got.message
    assert got.message.content is None and len(got.message.tool_calls) == 1
    call = got.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # the offline engine under the same grammar writes the same call
    so = {"schema_type": "ebnf", "schema": calls_grammar({"weather": WEATHER}, parallel=False)}
    want = offline.chat(
        MESSAGES,
        SamplingParams(max_tokens=300, seq_seed=11, temperature=1.0, so_args=so),
        use_tqdm=False,
        tools=TOOLS,
    )[0]
    split = parse_tool_calls(want.outputs[0].text)
    assert [(c.name, c.arguments) for c in split.calls] == _calls(got.message) and split.content == ""
    # streamed: the same call, its id and name first, then the arguments in fragments
    content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kw))
    assert (content, calls, finish) == ("", _calls(got.message), "tool_calls")


def test_required_tool_choice_calls_allowed_tools_whole_and_streamed(client):
    kw = dict(model="micro", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=330, seed=5)
    for seed in (5, 6, 7):
        got = client.chat.completions.create(**(kw | {"seed": seed})).choices[0]
        assert got.finish_reason == "tool_calls" and got.message.tool_calls, got.message
        for name, arguments in _calls(got.message):
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        content, calls, finish = _streamed(
            client.chat.completions.create(stream=True, **(kw | {"seed": seed}))
        )
        assert (content, calls, finish) == ("", _calls(got.message), "tool_calls")


def test_auto_reads_calls_the_model_writes_and_none_leaves_them_as_text(client, offline):
    # no constraint: the random model writes no call markup, and its text is the offline engine's
    want = offline.chat(MESSAGES, SamplingParams(max_tokens=12, seq_seed=3), use_tqdm=False, tools=TOOLS)[0]
    got = client.chat.completions.create(model="micro", messages=MESSAGES, tools=TOOLS, max_tokens=12, seed=3)
    assert (
        got.choices[0].message.content == want.outputs[0].text and got.choices[0].message.tool_calls is None
    )
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    # a model that does write a call (a regex makes it): "auto" reads it, "none" returns the text
    text = f'{CALLS_BEGIN}{CALL_BEGIN}clock{CALL_SEP}{{"utc": true}}{CALL_END}{CALLS_END}'
    regex = r"Sure\." + text.replace("{", r"\{").replace("}", r"\}")
    kw = dict(model="micro", messages=MESSAGES, tools=TOOLS, max_tokens=150, seed=1)
    so = {"extra_body": {"so_args": {"schema_type": "regex", "schema": regex}}}
    auto = client.chat.completions.create(**kw, **so).choices[0]
    assert auto.message.content == "Sure." and _calls(auto.message) == [("clock", '{"utc": true}')]
    assert auto.finish_reason == "tool_calls"
    assert _streamed(client.chat.completions.create(stream=True, **kw, **so)) == (
        "Sure.",
        [("clock", '{"utc": true}')],
        "tool_calls",
    )
    # cut short anywhere, the whole message and the stream agree on content and calls
    for max_tokens in (3, 8, 14, 20):
        cut = client.chat.completions.create(**(kw | {"max_tokens": max_tokens}), **so).choices[0]
        whole = (cut.message.content or "", _calls(cut.message), cut.finish_reason)
        assert (
            _streamed(client.chat.completions.create(stream=True, **(kw | {"max_tokens": max_tokens}), **so))
            == whole
        )
        assert whole[2] == "length" and CALLS_BEGIN not in whole[0]
    none = client.chat.completions.create(tool_choice="none", **kw, **so).choices[0]
    assert none.message.content == "Sure." + text and none.message.tool_calls is None
    assert none.finish_reason == "stop"


def test_history_with_tool_calls_and_results_renders_as_llm_chat(client, offline):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "clock", "arguments": '{"utc": true}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'},
                },
            ],
        },
        # answered out of order: the ids, rendered with the calls and the results, pair them
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    want = offline.chat(history, SamplingParams(max_tokens=8, seq_seed=2), use_tqdm=False, tools=TOOLS)[0]
    assert "<｜tool▁output▁begin｜>[id: call_2]rain" in want.prompt
    assert f"[id: call_1]{CALL_BEGIN}clock{CALL_SEP}" in want.prompt
    got = client.chat.completions.create(model="micro", messages=history, tools=TOOLS, max_tokens=8, seed=2)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.choices[0].message.content == want.outputs[0].text
    # the same history without ids renders apart (the results then matched to calls by order)
    plain = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in history]
    plain[1] = plain[1] | {
        "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in history[1]["tool_calls"]]
    }
    by_order = offline.chat(plain, SamplingParams(max_tokens=8, seq_seed=2), use_tqdm=False, tools=TOOLS)[0]
    assert "[id: " not in by_order.prompt and len(by_order.prompt_token_ids) < len(want.prompt_token_ids)
    got = client.chat.completions.create(model="micro", messages=plain, tools=TOOLS, max_tokens=8, seed=2)
    assert got.usage.prompt_tokens == len(by_order.prompt_token_ids)
    assert got.choices[0].message.content == by_order.outputs[0].text


def test_auto_without_parallel_calls_keeps_the_first_call_only(client, offline):
    # a model that writes two calls (a regex makes it)
    two = (
        f'{CALLS_BEGIN}{CALL_BEGIN}clock{CALL_SEP}{{"utc": true}}{CALL_END}'
        f'{CALL_BEGIN}weather{CALL_SEP}{{"city": "Oslo", "days": 2}}{CALL_END}{CALLS_END}'
    )
    regex = r"Sure\." + two.replace("{", r"\{").replace("}", r"\}")
    kw = dict(model="micro", messages=MESSAGES, tools=TOOLS, max_tokens=150, seed=1)
    so = {"extra_body": {"so_args": {"schema_type": "regex", "schema": regex}}}
    both = [("clock", '{"utc": true}'), ("weather", '{"city": "Oslo", "days": 2}')]
    parallel = client.chat.completions.create(**kw, **so).choices[0]
    assert _calls(parallel.message) == both and parallel.finish_reason == "tool_calls"
    # without parallel calls: the first call, whole, and nothing after it; streamed alike
    for stop in (None, ["never"], "never"):
        one = dict(kw, parallel_tool_calls=False, **({} if stop is None else {"stop": stop}))
        single = client.chat.completions.create(**one, **so).choices[0]
        assert single.message.content == "Sure." and _calls(single.message) == both[:1]
        assert single.finish_reason == "tool_calls"
        assert _streamed(client.chat.completions.create(stream=True, **one, **so)) == (
            "Sure.",
            both[:1],
            "tool_calls",
        )
    # the text is the offline engine's up to the first call's end
    params = SamplingParams(
        max_tokens=150, seq_seed=1, stop=[CALL_END], so_args={"schema_type": "regex", "schema": regex}
    )
    want = offline.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS)[0].outputs[0]
    assert want.text == "Sure." + two[: two.index(CALL_END)] and want.finish_reason == "stop"
    # a forced call without parallel calls is one call by its grammar
    forced = client.chat.completions.create(
        **(kw | {"max_tokens": 300}), tool_choice="required", parallel_tool_calls=False
    ).choices[0]
    assert len(forced.message.tool_calls) == 1 and forced.finish_reason == "tool_calls"


def _bad(client, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**({"model": "micro", "messages": MESSAGES, "max_tokens": 4} | kw))
    return e.value.body


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
        (dict(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
            "tools[0].function.parameters",
        ),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "not": {"type": "object"}},
                        },
                    }
                ]
            ),
            "tools[0].function.parameters",
        ),
        (dict(tools=[{"type": "function"}]), "tools[0].function"),
        (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (
            dict(
                messages=[
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "call_1", "function": {"name": "clock", "arguments": "{}"}}],
                    },
                    {"role": "tool", "tool_call_id": "call_9", "content": "12:00"},
                ]
            ),
            "messages[2].tool_call_id",
        ),
        (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "call_1"}]), "messages[0]"),
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            ),
            "messages[0]",
        ),  # fmt: skip
    ],
)
def test_bad_tools_and_tool_choices_are_400_naming_the_field(client, kw, param):
    body = _bad(client, **kw)
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"], body


def test_a_forced_call_in_thinking_mode_engages_after_the_reasoning():
    req = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required")
    plan = plan_tools(req)
    assert plan.so_args(False, 128822) == {"schema_type": "ebnf", "schema": plan.grammar}
    assert plan.so_args(True, 128822)["trigger_token_ids"] == [128822]
    assert plan_tools(ChatCompletionRequest(messages=MESSAGES, tools=TOOLS)).so_args(True, 128822) is None
