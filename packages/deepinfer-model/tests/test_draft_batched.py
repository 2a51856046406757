"""The paged drafter drafts every sequence of a step in one batched forward (`draft_blocks`).

Oracle: `_draft_block_per_sequence` below is the per-sequence `draft_block` as it was before the
batched path replaced it (one sequence per forward: its own window and block keys, no padding, no
other rows), kept here verbatim rather than called through the library: the library's `draft_block`
is now `draft_blocks` for one sequence, so comparing against it could not catch a layout or masking
bug shared by every batch size. Each sequence's oracle is computed alone from the keys the paged
cache holds for it, so a row leaking into another sequence (a padded or foreign key made visible,
rows mixed by a reshape) changes that sequence's result and fails the bitwise comparison.

Exact numerics (FP64 carrier, one rounding per stored value): the batch changes only FP64 summation
orders (GEMM row counts, padded softmax lengths), which the single rounding hides (see
`batch_invariant`'s docstring for the rare exception); batch-invariant mode makes a sequence's drafts
independent of the batch by construction (tested below alone vs in a batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_model.layers.attention import project_latent, project_output, project_query, sink_attention
from deepinfer_model.layers.norm import rms_norm
from deepinfer_model.layers.rope import cos_sin
from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
from deepinfer_model.models.deepseek_v41.blocks import ShiftedHC, moe_ffn
from deepinfer_model.models.deepseek_v41.drafter import greedy
from deepinfer_model.models.deepseek_v41.drafter_heads import (
    confidence,
    confidence_temperatures,
    markov_correction,
)
from deepinfer_model.numerics import carrier, round_to
from deepinfer_model.numerics import logits as head_logits
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner

BLOCK = 4
# contexts around the tiny config's sliding window (8): shorter, equal, longer
LENGTHS = (3, 21, 8, 14, 5)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41draft"), seed=3))


@pytest.fixture(scope="module")
def bf16_kvq(fp32):
    """BF16 activations and quantised KV (FP8 drafter keys): the engine's numerics."""
    return DeepseekV41ForCausalLM(
        fp32.config, fp32.weights, fp32.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
    )


def _draft_block_per_sequence(
    cfg,
    w,
    embed,
    head,
    keys_main,
    next_token,
    last_position,
    num_draft_tokens,
    sampler,
    temperatures,
    act,
    kvq,
):
    """The pre-batching `draft_block` (one sequence), the oracle: see the module docstring."""
    ds, eps, W = cfg.dspark, cfg.rms_norm_eps, cfg.sliding_window
    a, bd = last_position, num_draft_tokens
    positions = torch.arange(a + 1, a + 1 + bd)
    tokens = torch.full((bd,), ds.noise_token_id, dtype=torch.long)
    tokens[0] = next_token
    cos, sin = cos_sin(cfg.main_rope(), positions)
    window = keys_main[:, max(0, a - W + 1) : a + 1]
    hc = ShiftedHC(embed[tokens].to(carrier()), cfg)
    for i, blk in enumerate(w.blocks):

        def attention(y, blk=blk, i=i):
            q, _ = project_query(y, blk.attn, cfg.num_attention_heads, cos, sin, eps, False, act)
            kd = kvq.swa(project_latent(y, blk.attn, cos, sin, eps, act))
            keys = torch.cat((window[i], kd), dim=0)
            visible = torch.ones(bd, keys.shape[0], dtype=torch.bool)
            o = sink_attention(q, keys, visible, blk.attn.sinks, cfg.head_dim**-0.5, act)
            return project_output(round_to(o, act), blk.attn, cfg.o_groups, cos, sin, act)

        hc.sublayer(blk.hc_attn, blk.attn_norm, attention, act)
        hc.sublayer(
            blk.hc_ffn,
            blk.ffn_norm,
            lambda y, blk=blk: moe_ffn(cfg, blk, y, ds.num_experts_per_tok, act),
            act,
        )
    hidden = hc.final(act)
    base = head_logits(rms_norm(hidden, w.norm, eps, act), head, act).to(carrier())
    temps = torch.as_tensor(temperatures, dtype=torch.float32).expand(bd)
    out_tokens, out_logits, out_conf = [], [], []
    prev = tokens[:1]
    for s in range(bd):
        logits, e = markov_correction(base[s : s + 1], prev, w.markov, act)
        out_conf.append(confidence(hidden[s : s + 1], e, w.confidence_proj, temps[s]))
        prev = torch.as_tensor(sampler(logits[0], s), dtype=torch.long).reshape(1)
        out_tokens.append(prev)
        out_logits.append(logits[0])
    return torch.cat(out_tokens), torch.stack(out_logits).float(), torch.cat(out_conf).float(), hidden


class KeyedSampler:
    """A draw from softmax(logits / 0.8) with a uniform keyed by (seed, draft step): stateless across
    calls, like the engine's draft streams, so call order cannot matter and a wrong row shows."""

    def __init__(self, seed: int):
        self.seed = seed

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        u = torch.rand(
            (), generator=torch.Generator().manual_seed(1000 * self.seed + step), dtype=torch.float64
        )
        q = torch.softmax(logits.double() / 0.8, dim=-1)
        return torch.searchsorted(torch.cumsum(q, 0), u.reshape(1), right=True)[0].clamp(max=q.numel() - 1)


def _prefilled(model, lengths=LENGTHS, seed=0):
    """A runner after one step of two chunks per sequence (a prefill and its tail, as one mixed step)."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(4, 256, n).tolist() for n in lengths]
    tables, nb = [], 0
    for n in lengths:
        k = -(-n // BLOCK)
        tables.append(np.arange(nb, nb + k, dtype=np.int32))
        nb += k
    runner = PagedRunner(model, num_blocks=nb, block_size=BLOCK)
    cut = [max(n - 2, 0) for n in lengths]
    for lo, hi in ((np.zeros(len(lengths), int), cut), (cut, list(lengths))):
        q = np.asarray(hi) - np.asarray(lo)
        runner.execute(
            StepBatch.of(
                seq_ids=np.arange(len(lengths)),
                start_positions=np.asarray(lo),
                query_lens=q,
                block_tables=tables,
                input_ids=np.concatenate([s[a:b] for s, a, b in zip(seqs, lo, hi)]),
                logits_lens=(q > 0).astype(np.int64),
            )
        )
    return runner, tables


def _oracle(model, runner, tables, k, next_token, last, bd, sampler):
    """Sequence k's draft alone, from the main keys its cache slots hold (positions 0 .. last)."""
    cfg, w = model.config, model.weights
    pos = np.arange(last + 1)
    slots = torch.from_numpy(tables[k][pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)
    keys = torch.stack([runner.cache.read(f"draft_main.{b}", slots) for b in range(len(w.drafter.blocks))])
    return _draft_block_per_sequence(
        cfg, w.drafter, w.embed, w.head, keys, next_token, last, bd, sampler,
        confidence_temperatures(bd), model.act_dtype, model.kvq,
    )  # fmt: skip


@pytest.mark.parametrize("numerics", ["fp32", "bf16_kvq"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_batched_drafts_equal_per_sequence_drafts(numerics, sampled, request):
    model = request.getfixturevalue(numerics)
    runner, tables = _prefilled(model)
    bd = 4
    # 1, 3 and 5 sequences; some drafting after an earlier (accepted) position than their last
    for seqs, lasts in (
        ([1], None),
        ([4, 0, 2], None),
        ([0, 1, 2, 3, 4], [2, 16, 7, 13, 1]),
    ):
        next_tokens = [int(t) for t in np.random.default_rng(len(seqs)).integers(4, 256, len(seqs))]
        samplers = [KeyedSampler(7 + k) if sampled else greedy for k in seqs]
        drafts = runner.draft(
            next_tokens, bd, seq_indices=seqs, sampler=samplers if sampled else None, last_positions=lasts
        )
        assert len(drafts) == len(seqs)
        for j, k in enumerate(seqs):
            last = LENGTHS[k] - 1 if lasts is None else lasts[j]
            tok, logits, conf, hidden = _oracle(
                model, runner, tables, k, next_tokens[j], last, bd, samplers[j]
            )
            d = drafts[j]
            assert torch.equal(d.tokens, tok), (numerics, seqs, k)
            assert torch.equal(d.logits, logits), (numerics, seqs, k)
            assert torch.equal(d.confidence, conf), (numerics, seqs, k)
            assert torch.equal(d.hidden, hidden), (numerics, seqs, k)
            assert torch.equal(d.positions, torch.arange(last + 1, last + 1 + bd))
        if sampled:  # the sampled drafts are not all the greedy ones (the sampler path is exercised)
            greedy_drafts = runner.draft(next_tokens, bd, seq_indices=seqs, last_positions=lasts)
            assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(drafts, greedy_drafts))


def test_rows_of_other_sequences_cannot_leak(fp32):
    """A sequence's draft does not change when its batch neighbours' next tokens do (while theirs do)."""
    runner, _ = _prefilled(fp32)
    a = runner.draft([10, 20, 30], 3, seq_indices=[0, 1, 2])
    b = runner.draft([10, 99, 77], 3, seq_indices=[0, 1, 2])
    assert torch.equal(a[0].logits, b[0].logits) and torch.equal(a[0].hidden, b[0].hidden)
    assert not torch.equal(a[1].logits, b[1].logits) and not torch.equal(a[2].logits, b[2].logits)


@pytest.mark.parametrize("numerics", ["fp32", "bf16_kvq"])
def test_batch_invariant_drafts_alone_equal_drafts_in_a_batch(numerics, request, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    model = request.getfixturevalue(numerics)
    runner, tables = _prefilled(model)
    next_tokens, lasts = [11, 200, 57, 90, 4], [2, 20, 6, 11, 4]
    samplers = [KeyedSampler(k) for k in range(5)]
    batch = runner.draft(next_tokens, 3, seq_indices=range(5), sampler=samplers, last_positions=lasts)
    for k in range(5):
        (alone,) = runner.draft(
            [next_tokens[k]], 3, seq_indices=[k], sampler=[samplers[k]], last_positions=[lasts[k]]
        )
        assert torch.equal(alone.tokens, batch[k].tokens)
        assert torch.equal(alone.logits, batch[k].logits)
        assert torch.equal(alone.confidence, batch[k].confidence)
        assert torch.equal(alone.hidden, batch[k].hidden)
        # and the mode's aligned key tiles hold the right keys: the per-sequence oracle's drafts (its
        # attention keeps the default summation order, so FP64 bits may differ before the rounding)
        tok, logits, conf, _ = _oracle(model, runner, tables, k, next_tokens[k], lasts[k], 3, samplers[k])
        assert torch.equal(batch[k].tokens, tok)
        torch.testing.assert_close(batch[k].logits, logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(batch[k].confidence, conf, rtol=0, atol=1e-6)


def test_bad_sampler_count_is_rejected(fp32):
    runner, _ = _prefilled(fp32, lengths=(5, 9))
    with pytest.raises(ValueError, match="one per sequence"):
        runner.draft([5, 6], 2, sampler=[greedy])
