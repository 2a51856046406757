"""Chat messages as the prompt text the checkpoint's chat template (or the DeepSeek default) makes of them,
and the images of their `image_url` parts (each an `<image>` in the text; `chat_images.py`). The server
takes images as `data:` URLs only: a client never makes it read a file or fetch a URL."""

from __future__ import annotations

import re

import jinja2

from ..chat_images import image_from_url
from ..engine.images import IMAGE_PLACEHOLDER
from ..tokenizer import render_chat
from .errors import bad_request
from .protocol import ChatMessage


def message_text(i: int, message: ChatMessage, images: list) -> str:
    """A message's content as text: a string, or its parts joined, an `<image>` for each `image_url` part
    (its image appended to `images`); other parts are refused."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if part.get("type") == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if isinstance(url, str) and url and not url.startswith("data:"):
                raise bad_request(
                    f"{where}: the server takes images as data: URLs only (no remote URL, file:// URL or "
                    "path is read)",
                    where,
                )
            try:
                images.append(image_from_url(url, where))
            except ValueError as e:
                raise bad_request(str(e), where) from None
            texts.append(IMAGE_PLACEHOLDER)
            continue
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}: only text ({{'type': 'text', 'text': ...}}) and image_url parts are supported",
                where,
            )
        texts.append(part["text"])
    return "".join(texts)


def _plain(i: int, m: ChatMessage, images: list) -> dict:
    # OpenAI's "developer" role is the system prompt of newer clients
    out = {"role": "system" if m.role == "developer" else m.role, "content": message_text(i, m, images)}
    if m.tool_calls:
        if m.role != "assistant":
            raise bad_request(
                f"messages[{i}].tool_calls: only assistant messages make tool calls", f"messages[{i}]"
            )
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            | ({} if c.id is None else {"id": c.id})
            for c in m.tool_calls
        ]
        out["content"] = None if m.content is None else out["content"]
    if m.tool_call_id is not None:
        if m.role != "tool":
            raise bad_request(
                f"messages[{i}].tool_call_id: only tool messages answer a tool call", f"messages[{i}]"
            )
        out["tool_call_id"] = m.tool_call_id
    return out


def render_messages(
    messages: list[ChatMessage],
    tokenizer_config: dict,
    add_generation_prompt: bool,
    chat_template_kwargs: dict | None,
    tools: list[dict] | None = None,
) -> tuple[str, list]:
    """(prompt text, the images of its `<image>` placeholders in order)."""
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    images: list = []
    plain = [_plain(i, m, images) for i, m in enumerate(messages)]
    try:
        return render_chat(
            plain, tokenizer_config, add_generation_prompt, chat_template_kwargs, tools
        ), images
    except ValueError as e:
        message = str(e)
        param = "messages"
        for field in ("chat_template_kwargs", "tools"):
            if message.startswith(field):
                param = field
        named = re.match(r"(messages\[\d+\][\w.\[\]]*):", message)  # the field a message check names
        if named:
            param = named.group(1)
        raise bad_request(message, param) from None
    except jinja2.TemplateError as e:
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None
