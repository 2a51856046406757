"""The tool-call parser (deepinfer/tool_calls.py) on its own: whole texts in the DeepSeek call format, and
the streaming parser, whose pieces must add up to the whole parse however the text is cut into deltas
(markers split across deltas included)."""

from deepinfer import ToolCall, ToolCallSplit, ToolCallStream, parse_tool_calls  # the public names
from deepinfer.tool_calls import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END
from hypothesis import given, settings
from hypothesis import strategies as st


def _call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{CALL_SEP}{args}{CALL_END}"


PARIS = '{"city": "Paris"}'
TWO_CALLS = f"Let me check.{CALLS_BEGIN}{_call('weather', PARIS)}\n{_call(' time ', '{}')}{CALLS_END}Done"


def test_whole_texts():
    assert parse_tool_calls("no calls <｜tool▁call") == ToolCallSplit("no calls <｜tool▁call", [])
    assert parse_tool_calls(TWO_CALLS) == ToolCallSplit(
        "Let me check.Done", [ToolCall("weather", PARIS), ToolCall("time", "{}")]
    )
    # cut short in the arguments: the call is kept with what it has; cut short in a name: dropped
    assert parse_tool_calls(f"{CALLS_BEGIN}{CALL_BEGIN}f{CALL_SEP}" + '{"a": ') == ToolCallSplit(
        "", [ToolCall("f", '{"a": ')]
    )
    assert parse_tool_calls(f"x{CALLS_BEGIN}{_call('f', '1')}{CALL_BEGIN}g") == ToolCallSplit(
        "x", [ToolCall("f", "1")]
    )
    # after the block, text (even a second block) is content again
    assert parse_tool_calls(f"{CALLS_BEGIN}{CALLS_END}{CALLS_BEGIN}").content == CALLS_BEGIN


def _merged(pieces) -> ToolCallSplit:
    content, names, args = "", [], []
    for piece in pieces:
        content += piece.content
        for d in piece.calls:
            if d.name is not None:
                assert d.index == len(names), "a call's name comes first, once, in order"
                names.append(d.name)
                args.append("")
            assert d.index == len(names) - 1, "arguments belong to the latest call"
            args[d.index] += d.arguments
    return ToolCallSplit(content, [ToolCall(n, a) for n, a in zip(names, args, strict=True)])


def _streamed(text: str, cuts: list[int]) -> ToolCallSplit:
    stream, pieces, last = ToolCallStream(), [], 0
    for cut in [*sorted(set(cuts)), len(text)]:
        pieces.append(stream.feed(text[last:cut]))
        last = cut
    pieces.append(stream.finish())
    return _merged(pieces)


def test_stream_by_characters_equals_whole():
    for text in (TWO_CALLS, TWO_CALLS[:-30], TWO_CALLS[:40], "plain <｜tool▁calls▁beg"):
        assert _streamed(text, list(range(len(text)))) == parse_tool_calls(text)


def test_content_waits_only_for_a_possible_marker():
    stream = ToolCallStream()
    assert stream.feed("Hi <｜tool").content == "Hi "
    assert stream.feed("box").content == "<｜toolbox"
    piece = stream.feed(f"{CALLS_BEGIN}{CALL_BEGIN}f{CALL_SEP}" + '{"a"')
    assert piece.content == "" and [(d.index, d.name, d.arguments) for d in piece.calls] == [(0, "f", '{"a"')]


_ALPHABET = ["a", " ", "{", "}", '"', "<｜tool", CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_SEP, CALL_END]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_ALPHABET), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_stream_equals_whole_for_any_text_and_cuts(parts, cuts):
    text = "".join(parts)
    assert _streamed(text, [c for c in cuts if c <= len(text)]) == parse_tool_calls(text)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(TWO_CALLS)), max_size=20))
def test_stream_equals_whole_for_any_cuts_of_a_call_block(cuts):
    assert _streamed(TWO_CALLS, cuts) == parse_tool_calls(TWO_CALLS)
