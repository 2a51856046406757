"""Shared fixtures: small random checkpoints carrying the real DeepSeek-V4 tokenizer.

The CPU reference model is exact but slow and the recompute runner is O(n^2), so engine tests use a
two-layer public-V4 model (sliding window + compressed sparse attention, hash MoE + MoE) and a small
vocabulary; `real_vocab_checkpoint` has the tokenizer's full vocabulary for tests that start from text.
"""

import sys
from pathlib import Path

import pytest
import torch
from deepinfer_model.testing import make_checkpoint
from deepinfer_model.testing.checkpoint import tiny_config

# Test helpers (image_common) live beside this file; importlib mode does not put this directory on
# sys.path by itself.
sys.path.insert(0, str(Path(__file__).parent))

from image_common import make_vision_checkpoint  # noqa: E402


def micro_config(vocab_size: int) -> dict:
    return tiny_config(
        vocab_size=vocab_size,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        n_routed_experts=4,
    )


@pytest.fixture(scope="session")
def micro_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v4-micro"), micro_config(512), seed=1)


@pytest.fixture(scope="session")
def real_vocab_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v4-micro-real-vocab"), micro_config(129280), seed=2)


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory):
    """The tiny V4.1 with a vision tower (image_common.make_vision_checkpoint)."""
    return make_vision_checkpoint(tmp_path_factory.mktemp("v41-vision"))


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny matrices gain nothing from threads; on a shared 2-core runner they only add sync stalls."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _fixed_verification_lengths():
    """These tests check the drafting mechanism with every draft verified (the reference's default),
    whose counts and tokens do not depend on measured times; the draft policy's own tests
    (`test_spec_policy_engine.py`, the varlen tests) switch it on. Session-wide, so that engines of
    module fixtures see it too; subprocesses inherit it."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
        yield


@pytest.fixture(scope="module")
def share_loaded_models():
    """Within a test module, the engine loads each (checkpoint, dtype, device) once: loading the V4.1
    builds the Engram vocabulary from the 129k-token tokenizer (seconds), and the model is read-only,
    so every engine of the module can share it."""
    from deepinfer.engine import llm_engine

    loaded, real = {}, llm_engine.load_model

    def load_once(path, dtype, **kw):
        key = (str(path), dtype, str(kw.get("device", "cpu")))
        if key not in loaded:
            loaded[key] = real(path, dtype, **kw)
        return loaded[key]

    llm_engine.load_model = load_once
    yield
    llm_engine.load_model = real


@pytest.fixture
def deep_ep():
    """Skips the test unless DeepEP can run here (`deep_ep` imports and CUDA is present)."""
    from deepinfer_parallel import deep_ep_available

    if not deep_ep_available():
        pytest.skip("deep_ep is not importable")


@pytest.fixture
def first_token_close():
    """Checker for runs that differ by BF16 rounding (DeepEP's BF16 rows and combine): every request's
    first token was chosen on the same context in both runs, so its top log-probabilities must mostly
    coincide and agree within 0.05; later tokens may differ after a flipped choice."""

    def check(got, want) -> None:
        for g, w in zip(got, want, strict=True):
            assert g.error is None, g.error
            a, b = g.outputs[0].top_logprobs[0], w.outputs[0].top_logprobs[0]
            shared = set(a) & set(b)
            assert len(shared) >= 3, (a, b)
            assert max(abs(a[t] - b[t]) for t in shared) < 0.05, (a, b)

    return check


@pytest.fixture(scope="session")
def engine_clean():
    """Checker for an `LLMEngine` between calls: no request or step left, the C++ scheduler's invariants
    hold and every KV block is free."""

    def check(engine) -> None:
        assert not engine.has_unfinished_requests()
        assert not engine.requests and not engine.seqs
        assert engine.scheduler.num_inflight_steps == 0
        engine.scheduler.check_invariants()
        stats = engine.scheduler_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], stats
        assert stats["num_waiting"] == 0 and stats["num_running"] == 0, stats

    return check
