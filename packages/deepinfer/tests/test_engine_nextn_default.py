"""DEEPINFER_USE_NEXTN_DECODE: the reference's default of 5 drafts for checkpoints with draft blocks,
none for the built-in random-weight model (unless asked for), 0 turns drafting off."""

import pytest
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-nextn"), seed=0)


def _nextn(**kw) -> int:
    engine = LLMEngine(EngineArgs(max_model_len=48, **kw))
    try:
        return engine.num_speculative_tokens
    finally:
        engine.close()


def test_checkpoint_with_draft_blocks_defaults_to_five(v41, monkeypatch):
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    assert _nextn(model=str(v41)) == 5
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    assert _nextn(model=str(v41)) == 0
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert _nextn(model=str(v41)) == 2


def test_builtin_random_model_drafts_only_when_asked(monkeypatch):
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    assert _nextn() == 0
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    assert _nextn() == 3
