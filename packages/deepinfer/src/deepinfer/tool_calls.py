"""Tool calls in a completion's text, in the DeepSeek chat format the built-in chat template renders
them in, found whole (`parse_tool_calls`) or delta by delta (`ToolCallStream`).

A completion that calls tools holds one block of calls, each naming a function and giving its
arguments as JSON text:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

Text before the block and after its end is the completion's content; text between calls is dropped.
A completion cut short inside a call keeps the call once its name is complete, with the arguments
so far; a call cut short inside its name is dropped. The markers are ordinary text of the
detokenized output (the tokenizer's markers are not special tokens, and a model may spell them out),
so both parsers work on text, and the stream's pieces always add up to `parse_tool_calls` of the
whole text, however the text was cut into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON text the model wrote, as written


@dataclass(frozen=True)
class ToolCallSplit:
    content: str
    calls: list[ToolCall]


def parse_tool_calls(text: str) -> ToolCallSplit:
    """A whole completion's content and tool calls."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return ToolCallSplit(text, [])
    content, rest, calls = text[:start], text[start + len(CALLS_BEGIN) :], []
    while True:
        begin, end = rest.find(CALL_BEGIN), rest.find(CALLS_END)
        if end >= 0 and (begin < 0 or end < begin):
            return ToolCallSplit(content + rest[end + len(CALLS_END) :], calls)
        if begin < 0:
            return ToolCallSplit(content, calls)
        rest = rest[begin + len(CALL_BEGIN) :]
        sep = rest.find(CALL_SEP)
        if sep < 0:
            return ToolCallSplit(content, calls)
        name, rest = rest[:sep].strip(), rest[sep + len(CALL_SEP) :]
        stop = rest.find(CALL_END)
        if stop < 0:
            calls.append(ToolCall(name, rest))
            return ToolCallSplit(content, calls)
        calls.append(ToolCall(name, rest[:stop]))
        rest = rest[stop + len(CALL_END) :]


@dataclass
class ToolCallDelta:
    """New text of call `index`: its name once (in the first delta of the call), then arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamPiece:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def _partial_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper start of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


_CONTENT, _BETWEEN, _NAME, _ARGS, _AFTER = range(5)


class ToolCallStream:
    """The tool calls of one completion, fed its text delta by delta.

    `feed(delta)` returns the content and call deltas that are certain now (text that may be the start
    of a marker waits for the next delta); `finish()` the rest once the completion ended.
    """

    def __init__(self) -> None:
        self._state = _CONTENT
        self._buf = ""  # text not yet given out: a possible partial marker, or a name being read
        self.num_calls = 0

    def feed(self, delta: str) -> StreamPiece:
        piece = StreamPiece()
        text, self._buf = self._buf + delta, ""
        while text:
            text = self._step(text, piece)
        return piece

    def finish(self) -> StreamPiece:
        piece, rest = StreamPiece(), self._buf
        self._buf = ""
        if self._state in (_CONTENT, _AFTER):
            piece.content = rest
        elif self._state == _ARGS and rest:
            piece.calls.append(ToolCallDelta(self.num_calls - 1, arguments=rest))
        return piece

    def _step(self, text: str, piece: StreamPiece) -> str:
        """Consume what can be decided of `text`; return the rest still to consume (the undecided end
        goes to the buffer)."""
        if self._state == _AFTER:
            piece.content += text
            return ""
        if self._state == _CONTENT:
            return self._until(text, CALLS_BEGIN, _BETWEEN, lambda t: _add_content(piece, t))
        if self._state == _BETWEEN:
            begin, end = text.find(CALL_BEGIN), text.find(CALLS_END)
            if end >= 0 and (begin < 0 or end < begin):
                self._state = _AFTER
                return text[end + len(CALLS_END) :]
            if begin >= 0:
                self._state = _NAME
                return text[begin + len(CALL_BEGIN) :]
            self._buf = text[len(text) - _partial_len(text, (CALL_BEGIN, CALLS_END)) :]
            return ""
        if self._state == _NAME:
            sep = text.find(CALL_SEP)
            if sep < 0:
                self._buf = text
                return ""
            piece.calls.append(ToolCallDelta(self.num_calls, name=text[:sep].strip()))
            self.num_calls += 1
            self._state = _ARGS
            return text[sep + len(CALL_SEP) :]
        return self._until(text, CALL_END, _BETWEEN, lambda t: self._add_arguments(piece, t))

    def _until(self, text: str, marker: str, then: int, emit) -> str:
        """Emit `text` up to `marker` and switch to state `then` after it; without the marker, emit all
        but a possible partial marker at the end."""
        at = text.find(marker)
        if at >= 0:
            emit(text[:at])
            self._state = then
            return text[at + len(marker) :]
        hold = _partial_len(text, (marker,))
        emit(text[: len(text) - hold])
        self._buf = text[len(text) - hold :]
        return ""

    def _add_arguments(self, piece: StreamPiece, text: str) -> None:
        if not text:
            return
        index = self.num_calls - 1
        if piece.calls and piece.calls[-1].index == index:
            piece.calls[-1].arguments += text
        else:
            piece.calls.append(ToolCallDelta(index, arguments=text))


def _add_content(piece: StreamPiece, text: str) -> None:
    piece.content += text
