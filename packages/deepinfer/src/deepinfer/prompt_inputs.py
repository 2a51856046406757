"""The prompt forms `LLM.generate` accepts, as vLLM users write them.

One prompt is a string, a list of token ids, `{"prompt": str}` or `{"prompt_token_ids": list[int]}`
(a dict may carry both: the ids are run, the text is reported as the output's prompt). A dict may also
carry `"multi_modal_data": {"image": [...]}` (the engine checks it: `engine/images.py`). `prompts`
is one prompt or a list of them; a list of ints is one token prompt, never a batch of one-token
prompts.

Here only the form is decided: a token prompt is a list (or tuple) of integers. Whether each id is a
usable token (not a bool, inside the vocabulary) is the engine's check (`engine/request_checks.py`),
whose message names the position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

_DICT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


@dataclass
class ParsedPrompt:
    text: str | None
    token_ids: list[int] | None
    error: str | None = None  # what is wrong with this prompt (the request fails alone or raises)
    multi_modal_data: dict | None = None  # a dict prompt's images, as given


def _is_token_list(value) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(t, Integral) for t in value)


def _token_ids(value, where: str) -> list[int]:
    if not isinstance(value, list | tuple) or not _is_token_list(value):
        raise ValueError(f"{where} must be a list of int token ids, got {_describe(value)}")
    return list(value)  # as given: the engine's check names a bad id by its position


def _describe(value) -> str:
    if isinstance(value, list | tuple):
        bad = next((t for t in value if not isinstance(t, Integral)), None)
        return f"a {type(value).__name__} holding {type(bad).__name__} {bad!r}"
    return f"{type(value).__name__} {value!r}"[:120]


def parse_prompt(prompt, where: str) -> ParsedPrompt:
    """One prompt in any accepted form; a malformed one gets `error` naming `where` and the forms."""
    try:
        if isinstance(prompt, str):
            return ParsedPrompt(prompt, None)
        if isinstance(prompt, list | tuple):
            return ParsedPrompt(None, _token_ids(prompt, where))
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - set(_DICT_KEYS))
            if unknown:
                raise ValueError(f"{where} has unsupported keys {unknown}; allowed: {list(_DICT_KEYS)}")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{where}['prompt'] must be a str, got {_describe(text)}")
            mm = prompt.get("multi_modal_data")
            if "prompt_token_ids" in prompt:
                ids = _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
                return ParsedPrompt(text, ids, multi_modal_data=mm)
            if text is None:
                raise ValueError(
                    f"{where} must have a 'prompt' (str) or 'prompt_token_ids' (list of int) key"
                )
            return ParsedPrompt(text, None, multi_modal_data=mm)
        raise ValueError(
            f"{where} must be a str, a list of token ids, {{'prompt': str}} or "
            f"{{'prompt_token_ids': list[int]}}, got {_describe(prompt)}"
        )
    except ValueError as e:
        return ParsedPrompt(None, None, str(e))


def parse_prompts(prompts, prompt_token_ids=None) -> list[ParsedPrompt]:
    """`prompts` in any accepted form (one or a list), and the older `prompt_token_ids` argument
    (one id list or a list of them, aligned with `prompts` when both are given)."""
    if prompts is None and prompt_token_ids is None:
        raise ValueError("either prompts or prompt_token_ids must be given")
    parsed: list[ParsedPrompt] | None = None
    if prompts is not None:
        if isinstance(prompts, str | dict) or (_is_token_list(prompts) and prompts):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or isinstance(prompts, str):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {_describe(prompts)}")
        # beside prompt_token_ids, a None prompt only labels nothing (the ids are the prompt)
        parsed = [
            ParsedPrompt(None, None)
            if p is None and prompt_token_ids is not None
            else parse_prompt(p, f"prompts[{i}]")
            for i, p in enumerate(prompts)
        ]
    if prompt_token_ids is None:
        return parsed
    if _is_token_list(prompt_token_ids) and len(prompt_token_ids):
        prompt_token_ids = [prompt_token_ids]
    ids = [
        parse_prompt(list(t) if isinstance(t, tuple) else t, f"prompt_token_ids[{i}]")
        for i, t in enumerate(prompt_token_ids)
    ]
    for i, p in enumerate(ids):
        if p.error is None and p.token_ids is None:
            p.error = (
                f"prompt_token_ids[{i}] must be a list of int token ids, got {_describe(prompt_token_ids[i])}"
            )
    if parsed is None:
        return ids
    if len(parsed) != len(ids):
        raise ValueError(
            f"prompts ({len(parsed)}) and prompt_token_ids ({len(ids)}) must have the same length"
        )
    return [
        ParsedPrompt(p.text, q.token_ids, p.error or q.error, p.multi_modal_data) for p, q in zip(parsed, ids)
    ]
