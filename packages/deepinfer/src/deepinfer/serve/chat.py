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


def render_messages(
    messages: list[ChatMessage],
    tokenizer_config: dict,
    add_generation_prompt: bool,
    chat_template_kwargs: dict | None,
) -> str:
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    plain = [
        # OpenAI's "developer" role is the system prompt of newer clients
        {"role": "system" if m.role == "developer" else m.role, "content": message_text(i, m)}
        for i, m in enumerate(messages)
    ]
    try:
        return render_chat(plain, tokenizer_config, add_generation_prompt, chat_template_kwargs)
    except ValueError as e:
        raise bad_request(
            str(e), "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
        ) from None
    except jinja2.TemplateError as e:
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None
