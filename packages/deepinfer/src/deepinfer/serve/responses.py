"""Response bodies of the two endpoints: whole responses, streamed chunks, logprobs and usage.

A stream sends each choice's text as deltas of the cumulative outputs `AsyncLLM` produces; `ChoiceCursor`
remembers how much of a choice was sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..outputs import CompletionOutput


@dataclass
class ChoiceCursor:
    text: int = 0  # characters sent
    tokens: int = 0  # tokens whose logprobs were sent
    started: bool = False  # the first chunk (chat: the role) was sent
    finished: bool = False


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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
