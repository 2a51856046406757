"""The chat format the engine renders prompts in (`deepinfer.tokenizer`'s default DeepSeek template).

The recipe does not import the engine (it trains where only the model package is on the path), so the
template is restated here; a test checks that both render every conversation the same.
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def render_exchange(user: str, assistant: str) -> str:
    """One user turn and its answer, as the template renders them (BOS first, EOS after the answer)."""
    return f"{BOS}{USER}{user}{ASSISTANT}{assistant}{EOS}"
