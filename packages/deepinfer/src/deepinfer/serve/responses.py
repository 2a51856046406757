"""Response bodies of the two endpoints: whole responses, streamed chunks, logprobs and usage.

A stream sends each choice's text as deltas of the cumulative outputs `AsyncLLM` produces; `ChoiceCursor`
remembers how much of a choice was sent. A chat completion in thinking mode (`reasoning.py`) carries its
reasoning as `reasoning_content` beside `content`, in whole messages and in deltas alike; one whose
request reads tool calls (`tools.py`) carries the calls its content holds as `tool_calls`, whole or
streamed OpenAI's way (per call its index, id and function name first, then argument fragments).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ..outputs import CompletionOutput, RequestOutput
from ..reasoning import ReasoningStream, split_reasoning
from ..tool_calls import StreamPiece, ToolCallStream, parse_tool_calls


@dataclass
class ChoiceCursor:
    text: int = 0  # characters sent
    tokens: int = 0  # tokens whose logprobs were sent
    started: bool = False  # the first chunk (chat: the role) was sent
    finished: bool = False
    reasoning: ReasoningStream | None = None  # chat in thinking mode: the reasoning / content split so far
    tools: ToolCallStream | None = None  # chat reading tool calls: the calls in the content so far
    tool_ids: list[str] = field(default_factory=list)  # the ids given to those calls


class TokenText:
    """A token id as the text OpenAI's logprobs show for it (decoded alone, specials kept)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def completion_logprobs(
    out: CompletionOutput, start: int, end: int, token_text: TokenText, offset: int
) -> dict:
    """The legacy completions format for tokens [start, end): offsets count from `offset`."""
    tokens = [token_text(t) for t in out.token_ids[start:end]]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": out.token_logprobs[start:end],
        "top_logprobs": [{token_text(t): lp for t, lp in top.items()} for top in out.top_logprobs[start:end]],
        "text_offset": offsets,
    }


def prompt_logprobs(out: RequestOutput, k: int, token_text: TokenText, bos_token_id: int | None) -> dict:
    """The echoed prompt's tokens in the legacy completions format: the first has no logprob (nothing
    precedes it); offsets index the echoed text, which shows no BOS."""
    tokens, logprobs, tops, offsets, pos = [], [], [], [], 0
    for i, (token, entry) in enumerate(zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)):
        text = token_text(token)
        tokens.append(text)
        offsets.append(pos)
        if entry is None:
            logprobs.append(None)
            tops.append(None)
        else:
            logprobs.append(entry[token].logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            tops.append({token_text(t): lp.logprob for t, lp in ranked if lp.rank <= k})
        if not (i == 0 and token == bos_token_id):
            pos += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(first: dict, then: dict) -> dict:
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(out: CompletionOutput, start: int, end: int, token_text: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for i in range(start, end):
        item = entry(out.token_ids[i], out.token_logprobs[i])
        item["top_logprobs"] = [entry(t, lp) for t, lp in out.top_logprobs[i].items()]
        content.append(item)
    return {"content": content}


def chat_message(text: str, thinking: bool) -> dict:
    """A whole chat completion's message; in thinking mode the reasoning apart from the answer, whose
    `content` is None when the completion ended before its reasoning did."""
    if not thinking:
        return {"role": "assistant", "content": text}
    split = split_reasoning(text)
    return {"role": "assistant", "reasoning_content": split.reasoning, "content": split.content}


def chat_delta(text: str, cur: ChoiceCursor, thinking: bool, finished: bool) -> dict:
    """The delta of a chat stream for `text`, new since the last chunk. In thinking mode the reasoning
    goes in `reasoning_content` and the answer in `content` (both when a chunk holds the end of the
    reasoning); text that may be the start of the think-end marker waits for the next chunk."""
    delta = {} if cur.started else {"role": "assistant"}
    if not thinking:
        return delta | {"content": text}
    if cur.reasoning is None:
        cur.reasoning = ReasoningStream()
    reasoning, content = cur.reasoning.feed(text)
    if finished:
        rest, _ = cur.reasoning.finish()
        reasoning += rest
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content or not reasoning:  # a chunk without new text still says which part it continues
        delta["content" if content or not cur.reasoning.in_reasoning else "reasoning_content"] = content
    return delta


def _tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def with_tool_calls(message: dict, finish_reason: str | None) -> tuple[dict, str | None]:
    """A whole message with the tool calls its content holds, and the finish reason: "tool_calls" for a
    completion that ended by itself after calling (one cut short keeps "length")."""
    if message["content"] is None:
        return message, finish_reason
    split = parse_tool_calls(message["content"])
    if not split.calls:  # a block cut short before its first call's name ends holds no call
        return message | {"content": split.content}, finish_reason
    calls = [
        {"id": _tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in split.calls
    ]
    message = message | {"content": split.content or None, "tool_calls": calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def tool_call_delta(delta: dict, cur: ChoiceCursor, finished: bool) -> dict:
    """A chat delta whose content is read for tool calls: the content outside the call block stays
    `content`, the calls go in `tool_calls`."""
    content = delta.pop("content", None)
    if cur.tools is None:
        cur.tools = ToolCallStream()
    piece = cur.tools.feed(content) if content is not None else StreamPiece()
    if finished:
        rest = cur.tools.finish()
        piece.content += rest.content
        piece.calls += rest.calls
    calls = []
    for d in piece.calls:
        if calls and d.name is None and calls[-1]["index"] == d.index:
            calls[-1]["function"]["arguments"] += d.arguments
        elif d.name is not None:
            cur.tool_ids.append(_tool_call_id())
            function = {"name": d.name, "arguments": d.arguments}
            calls.append(
                {"index": d.index, "id": cur.tool_ids[d.index], "type": "function", "function": function}
            )
        else:
            calls.append({"index": d.index, "function": {"arguments": d.arguments}})
    if piece.content or (content is not None and not calls):
        delta["content"] = piece.content
    if calls:
        delta["tool_calls"] = calls
    return delta


def stream_finish_reason(cur: ChoiceCursor, finish_reason: str | None) -> str | None:
    called = cur.tools is not None and cur.tools.num_calls > 0
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
