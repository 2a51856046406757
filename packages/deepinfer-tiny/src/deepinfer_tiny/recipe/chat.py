"""One exchange in the chat format checkpoints carry (`deepinfer_model.DEFAULT_CHAT_TEMPLATE`), as text.

Training text is built by string formatting, thousands of exchanges at a time; a test checks that the template
renders the same text.
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"


def render_exchange(user: str, assistant: str) -> str:
    """One user turn and its answer, as the template renders them (BOS first, EOS after the answer)."""
    return f"{BOS}{USER}{user}{ASSISTANT}{assistant}{EOS}"
