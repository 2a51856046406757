"""The requests of `deepinfer generate`: --prompt strings or the lines of an --input JSONL file.

Each line is checked on its own before the model loads; a bad one becomes an error that names the
line and the request's id, and the others still run. What needs the model's tokenizer (rendering
`messages` with the chat template, encoding, the prompt length) is checked per request after loading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CliError

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


@dataclass
class InputRequest:
    index: int  # position among the requests (0-based); the engine's request id
    line: int | None  # line number in --input (1-based), None for --prompt
    record: dict = field(default_factory=dict)
    params: Any = None  # SamplingParams, once the line's fields passed
    error: str | None = None

    @property
    def has_id(self) -> bool:
        return "id" in self.record

    @property
    def user_id(self):
        return self.record.get("id")

    @property
    def resume_key(self) -> tuple[str, Any]:
        """What identifies this request in an earlier run's output: its id, else its position."""
        return ("id", self.user_id) if self.has_id else ("index", self.index)

    def label(self, source: Path | None) -> str:
        """How messages name the request: the user's id, else its position; and the line."""
        who = f"request {self.user_id!r}" if self.has_id else f"request #{self.index}"
        return f"{who} ({source}:{self.line})" if self.line is not None else who


def read_requests(
    prompts: list[str] | None, source: Path | None, defaults: dict, images: list[str] | None = None
) -> list[InputRequest]:
    """Every request with its SamplingParams, or the reason it is refused. `images`: the --image files,
    given to every --prompt."""
    from ..sampling_params import SamplingParams

    if prompts:
        extra = {"images": list(images)} if images else {}
        items = [(None, {"prompt": p, **extra}, None) for p in prompts]
    else:
        items = list(_lines(source))
    requests, seen_ids = [], {}
    for index, (line, record, error) in enumerate(items):
        req = InputRequest(index, line, record if isinstance(record, dict) else {}, error=error)
        if req.error is None:
            req.error = _check_record(record)
        if req.error is None and req.has_id:
            if req.user_id in seen_ids:
                req.error = f"duplicate id {req.user_id!r} (first on line {seen_ids[req.user_id]})"
            else:
                seen_ids[req.user_id] = line
        if req.error is None:
            try:
                req.params = SamplingParams(**_sampling_fields(defaults, record.get("sampling_params", {})))
            except TypeError as e:  # an unknown field name
                req.error = f"sampling_params: {e}".replace("SamplingParams.__init__() ", "")
            except ValueError as e:
                req.error = f"sampling_params: {e}"
        requests.append(req)
    return requests


def _sampling_fields(defaults: dict, overrides: dict) -> dict:
    """The flags' fields overridden by a line's; a line's `seed` (vLLM's name of `seq_seed`) replaces
    the --seq-seed default instead of clashing with it."""
    fields = {**defaults, **overrides}
    if "seed" in overrides and "seq_seed" not in overrides:
        fields.pop("seq_seed", None)
    return fields


def _lines(source: Path):
    if not source.is_file():
        raise CliError(f"--input {source}: no such file")
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"--input {source}: cannot read it: {e}") from None
    for line, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            yield line, json.loads(raw), None
        except json.JSONDecodeError as e:
            yield line, {}, f"invalid JSON: {e}"


def _check_record(record) -> str | None:
    """The reason a parsed line cannot be a request, or None."""
    if not isinstance(record, dict):
        return f"must be a JSON object, got {type(record).__name__}"
    given = [k for k in PROMPT_KEYS if k in record]
    if not given:
        return "needs a 'prompt', 'prompt_token_ids' or 'messages' key"
    if "messages" in record and len(given) > 1:
        return "'messages' cannot be combined with 'prompt' or 'prompt_token_ids'"
    if "id" in record and (isinstance(record["id"], bool) or not isinstance(record["id"], str | int)):
        return f"id must be a string or an integer, got {record['id']!r}"
    if "prompt" in record and not isinstance(record["prompt"], str):
        return f"prompt must be a string, got {type(record['prompt']).__name__}"
    ids = record.get("prompt_token_ids")
    if "prompt_token_ids" in record and (
        not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids)
    ):
        return "prompt_token_ids must be a list of integers"
    messages = record.get("messages")
    if "messages" in record and (
        not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages)
    ):
        return "messages must be a non-empty list of {'role': ..., 'content': ...} objects"
    images = record.get("images")
    if "images" in record and (
        not isinstance(images, list) or not images or not all(isinstance(x, str) for x in images)
    ):
        return "images must be a non-empty list of image paths or data: URLs"
    if "images" in record and "prompt" not in record and "prompt_token_ids" not in record:
        return (
            "'images' needs a 'prompt' with <image> placeholders or 'prompt_token_ids' with image "
            "placeholder ids (or use image_url parts in 'messages')"
        )
    sp = record.get("sampling_params", {})
    if not isinstance(sp, dict):
        return f"sampling_params must be an object of SamplingParams fields, got {sp!r}"
    return None
