"""Native mode with BF16 activations holds values already rounded to BF16 in BF16 where every consumer takes
them (`numerics.narrow_act`): the mHC trunk, the read feeding each norm and the norm's output (each
sub-layer's input: attention projections, compressor, indexer weights, YOCO's shared hidden, the router and
the experts), the attention's query, output and output projections, the index scores.

The values are the ones the FP32 carrier held, so the logits (and every other output: drafts, features,
main keys, cached pools) must be bitwise those of the widened tensors; only the bytes moved per step change.
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
)
from deepinfer_model.models.deepseek_v41.paged import attention as paged_attention
from deepinfer_model.models.deepseek_v41.yoco import YocoMode, YocoSettings
from deepinfer_model.models.grouped_attention import index_scores
from deepinfer_model.ops import model_calls
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.runtime.cuda_graphs import DecodeGraphSettings
from deepinfer_model.testing import batch_of, grow_tables


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41narrow"), seed=4))


@pytest.fixture(scope="module")
def bf16_model(fp32_model):
    m = fp32_model
    return DeepseekV41ForCausalLM(m.config, m.weights, m.engram.vocab, act_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def engine_model(fp32_model):
    """BF16 activations and quantised KV: the engine's numerics."""
    m = fp32_model
    return DeepseekV41ForCausalLM(
        m.config, m.weights, m.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
    )


def _wide(mp: pytest.MonkeyPatch) -> None:
    """No value held narrow: the FP32 carrier everywhere (every module that asks `narrow_act`)."""
    for module in (numerics, model_calls, paged_attention, index_scores):
        if hasattr(module, "narrow_act"):
            mp.setattr(module, "narrow_act", lambda act: False)


def _record_dtypes(monkeypatch, name: str) -> list:
    """`blocks.<name>` wrapped for the test: the list it returns gets the dtype of each call's output."""
    dtypes, op = [], getattr(blocks, name)

    def recorded(*args, **kwargs):
        out = op(*args, **kwargs)
        dtypes.append(out.dtype)
        return out

    monkeypatch.setattr(blocks, name, recorded)
    return dtypes


def _narrow_and_wide(monkeypatch, run):
    """`run()` in native mode as it is and with `_wide`, each after asserting that every sub-layer input
    (`ShiftedHC`'s norm output) was BF16 and FP32 respectively: (narrow outputs, wide outputs)."""
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    inputs = _record_dtypes(monkeypatch, "rms_norm")
    narrow = run()
    assert inputs and set(inputs) == {torch.bfloat16}
    inputs.clear()
    with monkeypatch.context() as mp:
        _wide(mp)
        wide = run()
    assert inputs and set(inputs) == {torch.float32}
    return narrow, wide


def _assert_bitwise(narrow, wide) -> None:
    """Equal lists of tensors (None where both are None), finite where floating."""
    assert len(narrow) == len(wide) > 0
    for i, (a, b) in enumerate(zip(narrow, wide, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, i
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        if a.dtype.is_floating_point:
            assert torch.isfinite(a).all(), i
        assert torch.equal(a, b), i


def _prefill(model, ids: np.ndarray) -> torch.Tensor:
    runner = PagedRunner(model, num_blocks=8, block_size=8)
    return runner.execute(
        StepBatch.of(
            seq_ids=np.array([0], dtype=np.int64),
            start_positions=np.zeros(1, dtype=np.int64),
            query_lens=np.array([len(ids)], dtype=np.int64),
            block_tables=[np.arange(8, dtype=np.int32)],
            input_ids=ids.astype(np.int64),
            logits_lens=np.array([len(ids)], dtype=np.int64),
        )
    )


def test_bf16_trunk_gives_the_widened_trunks_logits(bf16_model, monkeypatch):
    ids = np.random.default_rng(5).integers(4, bf16_model.config.vocab_size, 40)
    trunks = _record_dtypes(monkeypatch, "hc_write")
    narrow, wide = _narrow_and_wide(monkeypatch, lambda: [_prefill(bf16_model, ids)])
    assert set(trunks[: len(trunks) // 2]) == {torch.bfloat16}
    assert set(trunks[len(trunks) // 2 :]) == {torch.float32}
    _assert_bitwise(narrow, wide)


@pytest.mark.parametrize("yoco", [None, "mask", "compact"])
def test_stateless_forward_and_draft_with_narrow_sublayer_inputs(bf16_model, monkeypatch, yoco):
    """The stateless forward (compressed, indexed and candidate-restricted layers, Engram, MoE with a shared
    expert, YOCO's shared hidden S from the first consumer's input or, compact, from its own norm) and
    the drafter's blocks (their MoE) after it: every output bitwise the widened run's."""
    ids = torch.as_tensor(np.random.default_rng(6).integers(4, bf16_model.config.vocab_size, 40))
    kwargs = {} if yoco is None else {"yoco_keep_tokens": 16, "yoco_mode": yoco}

    def run():
        out = bf16_model.forward(ids, num_draft_tokens=4, return_trace=True, **kwargs)
        d = out.draft
        trace = [t for tr in out.trace for t in (tr.swa_keys, tr.index_scores, tr.selection)]
        return [out.logits, out.hidden, out.features, out.main_keys, d.tokens, d.logits, d.confidence, *trace]

    narrow, wide = _narrow_and_wide(monkeypatch, run)
    _assert_bitwise(narrow, wide)


def _draft_fields(drafts) -> list:
    return [getattr(d, f) for d in drafts for f in ("tokens", "logits", "confidence", "hidden", "positions")]


def test_paged_steps_graph_safe_decode_and_drafts(engine_model, monkeypatch):
    """Through the paged runner with (uncaptured) decode graphs, BF16 + quantised KV: a mixed prefill, a
    graph-safe decode step and verification step (`static_moe`'s router and experts), an eager batched
    draft and a graph-safe one, and every pool the steps wrote: bitwise the widened run's."""
    k, bs = 3, 4
    lengths = (21, 14, 9)

    def run():
        rng = np.random.default_rng(7)
        settings = DecodeGraphSettings(len(lengths) * (1 + k), 64, 4, capture=False, max_query_len=1 + k)
        runner = PagedRunner(engine_model, num_blocks=24, block_size=bs, decode_graphs=settings)
        free = [int(b) for b in rng.permutation(24)]
        seqs = [
            {"id": i, "tokens": list(rng.integers(4, 256, n)), "table": [], "n": 0}
            for i, n in enumerate(lengths)
        ]
        out = []

        def step(qlens, llens=None):
            grow_tables(seqs, qlens, free, bs)
            logits = runner.execute(batch_of(seqs, qlens, llens))
            for s, q in zip(seqs, qlens, strict=True):
                s["n"] += q
            out.append(logits)
            return logits

        step(list(lengths))  # prefill: eager
        replays = runner.graphs.replays
        for s, t in zip(seqs, out[-1].argmax(-1).tolist(), strict=True):
            s["tokens"].append(t)
        step([1, 1, 1])  # decode: graph-safe
        nxt = [int(t) for t in out[-1].argmax(-1)]
        for s, t in zip(seqs, nxt, strict=True):  # the next token and k arbitrary drafts to verify
            s["tokens"] += [t] + [int(x) for x in rng.integers(4, 256, k)]
        step([1 + k] * 3, [1 + k] * 3)  # verification: graph-safe
        assert runner.graphs.replays == replays + 2
        nxt = [int(t) for t in out[-1].view(3, 1 + k, -1)[:, -1].argmax(-1)]
        out += _draft_fields(runner.draft(nxt, k))  # eager batched draft
        draws = runner.draft_graphs.replays
        out += [
            getattr(d, f) for d in runner.draft(nxt, k, tokens_only=True) for f in ("tokens", "confidence")
        ]
        assert runner.draft_graphs.replays == draws + 1
        out += [runner.cache.pools[name] for name in sorted(runner.cache.pools)]
        return out

    narrow, wide = _narrow_and_wide(monkeypatch, run)
    assert len(narrow) == len(wide)
    for a, b in zip(narrow, wide, strict=True):  # (pools hold NaN in the slots never written)
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_paged_yoco_prefill_and_decode(bf16_model, monkeypatch, mode):
    """YOCO truncation in the paged runner (compact: S from the boundary's own norm, the consumer half on
    the kept rows only), a prefill then two decode steps."""
    keep, bs = 14, 4
    tokens = list(np.random.default_rng(8).integers(4, 256, 43))
    prompt = 40

    def run():
        runner = PagedRunner(bf16_model, 16, bs, yoco=YocoSettings(YocoMode(mode), keep), backtracking=6)
        table = np.arange(16, dtype=np.int32)
        out = []
        for start, q in ((0, prompt), (prompt, 1), (prompt + 1, 1)):
            batch = StepBatch.of(
                seq_ids=np.array([0]),
                start_positions=np.array([start]),
                query_lens=np.array([q]),
                block_tables=[table[: -(-(start + q) // bs)]],
                input_ids=np.asarray(tokens[start : start + q], dtype=np.int64),
                logits_lens=np.array([1]),
                prompt_lens=[prompt],
            )
            out.append(runner.execute(batch))
        return out

    narrow, wide = _narrow_and_wide(monkeypatch, run)
    _assert_bitwise(narrow, wide)


def test_exact_mode_keeps_the_carrier(bf16_model, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NUMERICS", "exact")
    trunks = _record_dtypes(monkeypatch, "hc_write")
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
