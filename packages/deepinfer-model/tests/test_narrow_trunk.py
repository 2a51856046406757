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


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_in_place_rope_gives_the_out_of_place_logits(bf16_model, monkeypatch, act):
    """Native mode: the query, index-query and output RoPE rotate their fresh tensors in place
    (`model_calls.rope(inplace=True)`: BF16 `narrow` tensors, or FP32 activations); the paged prefill's logits,
    and with FP32 activations the stateless forward's logits and drafts, are bitwise those of the out-of-place
    op."""
    from deepinfer_model.ops import get_ops

    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    m = bf16_model
    model = DeepseekV41ForCausalLM(m.config, m.weights, m.engram.vocab, act_dtype=act)
    ids = np.random.default_rng(6).integers(4, model.config.vocab_size, 40)
    table, calls = get_ops("cpu"), []
    real = table.apply_rope_
    monkeypatch.setattr(table, "apply_rope_", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))

    def run():
        out = [_prefill(model, ids)]
        if act == torch.float32:
            fwd = model.forward(torch.as_tensor(ids[:20]), num_draft_tokens=3)
            out += [fwd.logits, fwd.draft.tokens, fwd.draft.logits]
        return out

    in_place = run()
    cfg = model.config
    shapes = {s[1:] for s in calls}
    assert (cfg.num_attention_heads, cfg.head_dim) in shapes  # queries and outputs
    assert (cfg.index_n_heads, cfg.index_head_dim) in shapes  # index queries
    calls.clear()
    monkeypatch.setattr(model_calls, "_serves_in_place", lambda table: False)
    out_of_place = run()
    assert not calls
    for a, b in zip(in_place, out_of_place, strict=True):
        assert torch.equal(a, b)
