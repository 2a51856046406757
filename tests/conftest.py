"""Fixtures of the cross-package (reproducibility) tests: one intra-op thread, and engines on the paged
runner with the reproducibility switches set."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # 2 shared cores: oversubscription only makes tests slower; results do not depend on it.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def deterministic_env(monkeypatch):
    """What deterministic sampling requires (engine.md §5.4): batch invariance, varlen off."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")


def make_llm(**kwargs):
    """`LLM` on the default tiny model, running the paged (KV-cached) runner.

    The engine still builds the recompute runner; the paged one is a drop-in with bitwise equal logits
    (deepinfer_model.runtime README) and makes the O(n^2) recompute affordable here. It is the runner
    whose batching could break invariance, so it is the one these tests must exercise.
    """
    from deepinfer import LLM
    from deepinfer_model.runtime import make_runner

    kwargs.setdefault("num_threads", 1)
    llm = LLM(**kwargs)
    engine = llm.engine
    runner = make_runner("paged", engine.model, engine.runner.num_blocks, engine.runner.block_size)
    engine.runner = engine.worker.runner = runner
    return llm


@pytest.fixture(scope="session")
def llm_factory():
    return make_llm
