"""`LLM.get_tokenizer()` and chat rendering: DeepSeek's thinking modes, tool messages, template kwargs."""

import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.tokenizer import (
    ChatTokenizer,
    bundled_tokenizer_dir,
    load_tokenizer,
    load_tokenizer_config,
    render_chat,
)
from deepinfer_model import DEFAULT_CHAT_TEMPLATE, EARLIER_DEFAULT_CHAT_TEMPLATES

BOS = "<｜begin▁of▁sentence｜>"
CONFIG = {"bos_token": BOS, "chat_template": DEFAULT_CHAT_TEMPLATE}
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def test_plain_rendering_is_unchanged_without_thinking():
    history = [*USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    want = f"{BOS}Be brief.<｜User｜>2+2?<｜Assistant｜>4<｜end▁of▁sentence｜><｜User｜>3+3?<｜Assistant｜>"
    assert render_chat(history, CONFIG) == want
    # a checkpoint that carries the earlier built-in template renders the same, and gets the new modes
    old = {"bos_token": BOS, "chat_template": EARLIER_DEFAULT_CHAT_TEMPLATES[0]}
    assert render_chat(history, old) == want
    assert render_chat(USER, old, chat_template_kwargs={"thinking": True}).endswith("<｜Assistant｜><think>")


def test_thinking_and_non_thinking_modes():
    thinking = render_chat(USER, CONFIG, chat_template_kwargs={"thinking": True})
    direct = render_chat(USER, CONFIG, chat_template_kwargs={"thinking": False})
    assert thinking == f"{BOS}Be brief.<｜User｜>2+2?<｜Assistant｜><think>"
    assert direct == f"{BOS}Be brief.<｜User｜>2+2?<｜Assistant｜></think>"
    # earlier turns carry the closed reasoning marker in either mode
    history = [*USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    assert "<｜Assistant｜></think>4<｜end▁of▁sentence｜>" in render_chat(
        history, CONFIG, chat_template_kwargs={"thinking": True}
    )


def test_tool_calls_and_tool_messages():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
    ]
    got = render_chat(messages, CONFIG, chat_template_kwargs={"thinking": False})
    assert got == (
        f"{BOS}<｜User｜>Weather in Paris?<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather"
        '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        '<｜tool▁output▁begin｜>{"temp_c": 21}<｜tool▁output▁end｜><｜Assistant｜></think>'
    )


def test_tool_call_ids_name_the_call_each_result_answers():
    def call(call_id, city):
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": "weather", "arguments": {"city": city}},
        }

    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("call_a", "Paris"), call("call_b", "Oslo")],
        },
        # answered out of order: only the ids tell which result is whose
        {"role": "tool", "tool_call_id": "call_b", "content": "-3"},
        {"role": "tool", "tool_call_id": "call_a", "content": "21"},
    ]
    got = render_chat(messages, CONFIG, tools=[WEATHER_TOOL])
    assert got.endswith(
        "<｜Assistant｜><｜tool▁calls▁begin｜>"
        '[id: call_a]<｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
        '[id: call_b]<｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁output▁begin｜>[id: call_b]-3<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>[id: call_a]21<｜tool▁output▁end｜><｜Assistant｜>"
    )
    # the ids stand outside the calls' markup: the turn still parses to the calls as written
    from deepinfer import ToolCall, parse_tool_calls

    turn = got.split("<｜Assistant｜>")[1].split("<｜end▁of▁sentence｜>")[0]
    assert parse_tool_calls(turn).calls == [
        ToolCall("weather", '{"city": "Paris"}'),
        ToolCall("weather", '{"city": "Oslo"}'),
    ]
    # a checkpoint carrying an earlier built-in template renders the ids too
    for old in EARLIER_DEFAULT_CHAT_TEMPLATES:
        assert render_chat(messages, {**CONFIG, "chat_template": old}, tools=[WEATHER_TOOL]) == got
    # a result naming no earlier call is refused, naming the field
    for bad in ("call_c", 7):
        wrong = [*messages[:2], {"role": "tool", "tool_call_id": bad, "content": "-3"}]
        with pytest.raises(ValueError, match=r"^messages\[2\]\.tool_call_id: .* names no tool call"):
            render_chat(wrong, CONFIG, tools=[WEATHER_TOOL])
    # a result may not name a call that comes after it
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_call_id"):
        render_chat([messages[0], messages[2], messages[1]], CONFIG)


@pytest.mark.parametrize("thinking", [None, True, False])
def test_prompts_without_tool_call_ids_render_as_the_earlier_template(thinking):
    """The template before tool call ids (the last earlier built-in one), byte for byte, for every
    prompt that gives none: no tools, tools, tool calls and results matched by order."""
    before = {**CONFIG, "chat_template": EARLIER_DEFAULT_CHAT_TEMPLATES[-1]}
    assert EARLIER_DEFAULT_CHAT_TEMPLATES[-1] != DEFAULT_CHAT_TEMPLATE
    by_order = [
        *USER,
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "21"},
        {"role": "assistant", "content": "21 degrees."},
        {"role": "user", "content": "Thanks"},
    ]
    kwargs = None if thinking is None else {"thinking": thinking}
    for messages in (USER, by_order):
        for tools in (None, [WEATHER_TOOL]):
            for gen in (True, False):
                want = render_chat(messages, before, gen, kwargs, tools)
                assert render_chat(messages, CONFIG, gen, kwargs, tools) == want


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Today's weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_definitions_follow_the_system_prompt_and_parse_back():
    from deepinfer import ToolCall, parse_tool_calls

    plain = render_chat(USER, CONFIG)
    got = render_chat(USER, CONFIG, tools=[WEATHER_TOOL, {"type": "function", "function": {"name": "now"}}])
    head, tail = got.split("<｜User｜>", 1)
    assert "<｜User｜>" + tail == plain[plain.index("<｜User｜>") :]  # the conversation is untouched
    assert head.startswith(f"{BOS}Be brief.\n\n## Tools\n")
    assert (
        '### weather\nToday\'s weather in a city.\nArguments (JSON schema): {"type": "object", "properties"'
        in head
    )
    assert '### now\nArguments (JSON schema): {"type": "object"}\n' in head  # no description, no parameters
    # without a system prompt the tools come first; no tools (or none given) renders as before
    assert render_chat(USER[1:], CONFIG, tools=[WEATHER_TOOL]).startswith(f"{BOS}## Tools\n")
    assert render_chat(USER, CONFIG, tools=[]) == plain
    # a call written in the format the prompt describes is what the assistant turn renders and the parser reads
    call = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    turn = render_chat([*USER, {"role": "assistant", "content": None, "tool_calls": [call]}], CONFIG, False)
    answer = turn[turn.rindex("<｜Assistant｜>") + len("<｜Assistant｜>") : -len("<｜end▁of▁sentence｜>")]
    assert parse_tool_calls(answer).calls == [ToolCall("weather", '{"city": "Oslo"}')]
    # checkpoints carrying an earlier built-in template render tools the same
    for old in EARLIER_DEFAULT_CHAT_TEMPLATES:
        assert render_chat(USER, {**CONFIG, "chat_template": old}, tools=[WEATHER_TOOL]) == render_chat(
            USER, CONFIG, tools=[WEATHER_TOOL]
        )
    # a template that does not render tools refuses them rather than dropping them
    with pytest.raises(ValueError, match="tools: this checkpoint's chat template does not render"):
        render_chat(USER, {**CONFIG, "chat_template": "{{ messages[0]['content'] }}"}, tools=[WEATHER_TOOL])
    with pytest.raises(ValueError, match="tools must be a list"):
        render_chat(USER, CONFIG, tools=[{"name": "weather"}])
    with pytest.raises(ValueError, match="must not set 'tools'"):
        render_chat(USER, CONFIG, chat_template_kwargs={"tools": [WEATHER_TOOL]})


@pytest.mark.parametrize(
    "messages, kwargs, message",
    [
        ([{"role": "robot", "content": "x"}], None, r"messages\[0\] must be a dict with role"),
        ([{"role": "tool"}], None, r"messages\[0\] \(role tool\) must have a str 'content'"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}], None, "tool_calls"),
        (USER, {"thinkng": True}, r"chat_template_kwargs\['thinkng'\]: this checkpoint's chat template"),
        (USER, {"messages": []}, "must not set 'messages'"),
        ([], None, "messages must be a non-empty list"),
    ],
)
def test_bad_messages_and_kwargs_are_refused(messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        render_chat(messages, CONFIG, chat_template_kwargs=kwargs)


def test_chat_tokenizer_encode_decode_round_trip():
    path = bundled_tokenizer_dir()
    tok = ChatTokenizer(load_tokenizer(path), load_tokenizer_config(path), 0, 1)
    text = "Hello, world! 你好 🙂"
    ids = tok.encode(text)
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert ids[0] == 0 and ids[1:] == tok.encode(text, add_special_tokens=False)
    assert ids[1:] == load_tokenizer(path).encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS + text
    assert tok.token_to_id("<think>") is not None  # the HF tokenizer's own methods stay reachable
    assert tok.convert_ids_to_tokens(ids[:1]) == [BOS]


def test_llm_get_tokenizer_and_chat_modes(real_vocab_checkpoint):
    greedy = SamplingParams(max_tokens=1, temperature=0)
    with LLM(model=str(real_vocab_checkpoint), block_size=16, max_model_len=128) as llm:
        tok = llm.get_tokenizer()
        out = llm.generate("Hi there", greedy, use_tqdm=False)[0]
        assert tok.encode("Hi there") == out.prompt_token_ids
        assert tok.decode(out.prompt_token_ids) == "Hi there"
        think, direct = tok.token_to_id("<think>"), tok.token_to_id("</think>")
        for thinking, last in ((True, think), (False, direct)):
            out = llm.chat(USER, greedy, use_tqdm=False, chat_template_kwargs={"thinking": thinking})[0]
            assert out.prompt_token_ids[-2:] == [tok.token_to_id("<｜Assistant｜>"), last]
            assert out.prompt_token_ids == tok.apply_chat_template(USER, tokenize=True, thinking=thinking)
        tool = [*USER, {"role": "tool", "content": "42"}]
        out = llm.chat(tool, greedy, use_tqdm=False)[0]
        assert tok.token_to_id("<｜tool▁output▁begin｜>") in out.prompt_token_ids
