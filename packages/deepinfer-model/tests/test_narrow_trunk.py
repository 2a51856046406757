"""Native mode with BF16 activations holds values already rounded to BF16 in BF16 where every consumer takes
them (`numerics.narrow_act`): the mHC trunk, the read feeding each norm, the attention's query, output and
output projections, the index scores.

The values are the ones the FP32 carrier held, so the logits must be bitwise those of the widened tensors;
only the bytes moved per step change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_model import numerics
from deepinfer_model.models.deepseek_v41 import (
    DeepseekV41ForCausalLM,
    blocks,
    load_v41,
    make_v41_checkpoint,
    paged,
)
from deepinfer_model.ops import model_calls
from deepinfer_model.runner import RunnerBatch
from deepinfer_model.runtime import PagedRunner, groups


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    model = load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41narrow"), seed=4))
    return DeepseekV41ForCausalLM(model.config, model.weights, model.engram.vocab, act_dtype=torch.bfloat16)


def _prefill(model, ids: np.ndarray) -> torch.Tensor:
    runner = PagedRunner(model, num_blocks=8, block_size=8)
    return runner.execute(
        RunnerBatch(
            seq_ids=np.array([0], dtype=np.int64),
            start_positions=np.zeros(1, dtype=np.int64),
            query_lens=np.array([len(ids)], dtype=np.int64),
            block_tables=[np.arange(8, dtype=np.int32)],
            input_ids=ids.astype(np.int64),
            logits_lens=np.array([len(ids)], dtype=np.int64),
        )
    )


def test_bf16_trunk_gives_the_widened_trunks_logits(bf16_model, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    ids = np.random.default_rng(5).integers(4, bf16_model.config.vocab_size, 40)
    trunks = []
    write = blocks.hc_write

    def recorded(*args, **kwargs):
        out = write(*args, **kwargs)
        trunks.append(out.dtype)
        return out

    monkeypatch.setattr(blocks, "hc_write", recorded)
    narrow = _prefill(bf16_model, ids)
    assert trunks and set(trunks) == {torch.bfloat16}
    trunks.clear()
    for module in (numerics, model_calls, paged, groups):  # the FP32 carrier everywhere
        if hasattr(module, "narrow_act"):
            monkeypatch.setattr(module, "narrow_act", lambda act: False)
    wide = _prefill(bf16_model, ids)
    assert trunks and set(trunks) == {torch.float32}
    assert torch.isfinite(narrow).all()
    assert torch.equal(narrow, wide)


def test_exact_mode_keeps_the_carrier(bf16_model, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NUMERICS", "exact")
    trunks = []
    write = blocks.hc_write
    monkeypatch.setattr(
        blocks, "hc_write", lambda *a, **k: trunks.append(write(*a, **k).dtype) or write(*a, **k)
    )
    _prefill(bf16_model, np.arange(4, 20))
    assert trunks and set(trunks) == {torch.float64}
