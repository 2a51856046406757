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


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Run a test with 1 and with 2 intra-op threads (batch-invariant results must not depend on them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def deterministic_env(monkeypatch):
    """What deterministic sampling requires (engine.md §5.4): batch invariance, varlen off."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")


def make_llm(**kwargs):
    """`LLM` on the default tiny model, running the paged (KV-cached) runner: the runner whose grouped
    batching could break invariance, so the one these tests must exercise. It is built by the engine
    (not swapped in afterwards), so the engine's paged drafter reads this runner's caches."""
    from deepinfer import LLM

    kwargs.setdefault("num_threads", 1)
    kwargs.setdefault("runner", "paged")
    kwargs.setdefault("device", "cpu")  # the CPU checks stay on the CPU on a GPU machine (gpu tests ask)
    return LLM(**kwargs)


@pytest.fixture(scope="session")
def llm_factory():
    return make_llm
