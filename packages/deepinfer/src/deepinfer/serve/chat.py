"""Chat messages as the prompt text the checkpoint's chat template (or the DeepSeek default) makes of them."""

from __future__ import annotations

import jinja2

from ..tokenizer import render_chat
from .errors import bad_request
from .protocol import ChatMessage


def message_text(i: int, message: ChatMessage) -> str:
    """A message's content as text: a string, or its text parts joined (other parts are refused)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                f"messages[{i}].content[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _plain(i: int, m: ChatMessage) -> dict:
    # OpenAI's "developer" role is the system prompt of newer clients
    out = {"role": "system" if m.role == "developer" else m.role, "content": message_text(i, m)}
    if m.tool_calls:
        if m.role != "assistant":
            raise bad_request(
                f"messages[{i}].tool_calls: only assistant messages make tool calls", f"messages[{i}]"
            )
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls
        ]
        out["content"] = None if m.content is None else out["content"]
    return out


def render_messages(
    messages: list[ChatMessage],
    tokenizer_config: dict,
    add_generation_prompt: bool,
    chat_template_kwargs: dict | None,
    tools: list[dict] | None = None,
) -> str:
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    plain = [_plain(i, m) for i, m in enumerate(messages)]
    try:
        return render_chat(plain, tokenizer_config, add_generation_prompt, chat_template_kwargs, tools)
    except ValueError as e:
        message = str(e)
        param = "messages"
        for field in ("chat_template_kwargs", "tools"):
            if message.startswith(field):
                param = field
        raise bad_request(message, param) from None
    except jinja2.TemplateError as e:
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None
