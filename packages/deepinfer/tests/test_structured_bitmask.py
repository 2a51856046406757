"""Packed grammar masks on the logits (`deepinfer_model.sampling.TokenBitmask`) against xgrammar's own
`apply_token_bitmask_inplace` and a per-token Python reference; the sampler and draft verification
with packed masks against the same logits masked by xgrammar beforehand."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xg
from deepinfer.engine.spec_decode import VerifyInput, verify_logits
from deepinfer_model.sampling import (
    RowParams,
    Sampler,
    TokenBitmask,
    apply_token_bitmask_,
    disallowed_from_bitmask,
)
from deepinfer_spec import DraftVerifier


def random_bitmask(rows: int, vocab: int, gen: torch.Generator, density: float) -> torch.Tensor:
    """Random int32 masks whose words are a mix of all-zero, all-one and random bits."""
    words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    kind = torch.rand(rows, words, generator=gen)
    bits[kind < density] = 0
    bits[kind > 1 - density / 4] = -1
    return bits


def xgrammar_masked(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xg.apply_token_bitmask_inplace(out, full, vocab_size=logits.shape[1], backend="cpu")
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 129280])
def test_disallowed_matches_per_token_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    bitmask = random_bitmask(3, vocab, gen, density=0.5)
    got = disallowed_from_bitmask(bitmask, vocab)
    words = bitmask.tolist()
    sample = range(vocab) if vocab < 2000 else torch.randint(0, vocab, (4000,), generator=gen).tolist()
    for r in range(3):
        for t in sample:
            assert bool(got[r, t]) == (not (words[r][t // 32] >> (t % 32)) & 1), (r, t)


@pytest.mark.parametrize(
    ("vocab", "rows"),
    [
        (129280, [0, 1, 2, 3, 4, 5]),  # more rows than one CPU chunk
        (129280, [5, 0, 3]),  # unsorted, gathered
        (1000, [1, 4, 5]),
        (33, [2]),
        (4001, [0, 2, 4, 5]),
        (70, []),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_in_place_matches_xgrammar(vocab, rows, dtype):
    gen = torch.Generator().manual_seed(vocab + len(rows))
    logits = (torch.randn(6, vocab, generator=gen) * 4).to(dtype)
    bitmask = random_bitmask(len(rows), vocab, gen, density=0.6)
    want = xgrammar_masked(logits.float(), bitmask, rows).to(dtype)
    got = logits.clone()
    assert apply_token_bitmask_(got, TokenBitmask(bitmask, tuple(rows))) is got
    assert torch.equal(got, want)
    # a wider bitmask (tokenizer padding) than the logits: the extra bits are ignored
    wide = torch.cat([bitmask, torch.zeros(len(rows), 2, dtype=torch.int32)], dim=1)
    got = logits.clone()
    apply_token_bitmask_(got, TokenBitmask(wide, tuple(rows)))
    assert torch.equal(got, want)


def test_bad_masks_are_refused():
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="bitmask"):
        TokenBitmask(torch.zeros(2, 4, dtype=torch.int64), (0, 1))
    with pytest.raises(ValueError, match="rows"):
        TokenBitmask(torch.zeros(2, 4, dtype=torch.int32), (0,))
    with pytest.raises(ValueError, match="distinct"):
        TokenBitmask(torch.zeros(2, 4, dtype=torch.int32), (1, 1))
    with pytest.raises(ValueError, match="outside"):
        apply_token_bitmask_(logits, TokenBitmask(torch.zeros(1, 4, dtype=torch.int32), (2,)))
    with pytest.raises(ValueError, match="words"):
        apply_token_bitmask_(logits, TokenBitmask(torch.zeros(1, 3, dtype=torch.int32), (0,)))


def test_remap_moves_and_drops_rows():
    bitmask = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    mask = TokenBitmask(bitmask, (4, 7, 9))
    moved = mask.remap({4: 0, 9: 1})
    assert moved.rows == (0, 1)
    assert torch.equal(moved.bitmask, bitmask[[0, 2]])
    assert mask.remap({5: 0}) is None


def _rows(n: int, logprobs: int | None = None) -> list[RowParams]:
    # a mix of greedy, plain and filtered sampling, some with banned tokens
    out = []
    for i in range(n):
        kind = i % 4
        out.append(
            RowParams(
                temperature=0.0 if kind == 0 else 0.8,
                top_p=0.9 if kind == 2 else 1.0,
                top_k=40 if kind == 3 else -1,
                seed=100 + i,
                position=i,
                banned_token_ids=(3, 7) if i % 3 == 0 else (),
                logprobs=logprobs,
            )
        )
    return out


@pytest.mark.parametrize("constrained", [[0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 6], []])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_sampler_with_packed_mask_equals_pre_masked_logits(constrained, logprobs):
    vocab = 3000
    gen = torch.Generator().manual_seed(len(constrained))
    logits = torch.randn(8, vocab, generator=gen) * 3
    bitmask = random_bitmask(len(constrained), vocab, gen, density=0.9)
    rows = _rows(8, logprobs)
    want = Sampler()(xgrammar_masked(logits, bitmask, constrained), rows)
    given = logits.clone()
    got = Sampler()(given, rows, allowed=TokenBitmask(bitmask, tuple(constrained)), overwrite_logits=True)
    assert torch.equal(got.token_ids, want.token_ids)
    if logprobs is not None:  # raw logprobs: the caller's logits were left unmasked
        assert torch.equal(given, logits)
        raw = torch.log_softmax(logits, dim=-1)
        assert torch.equal(got.logprobs, raw.gather(1, got.token_ids[:, None]).squeeze(1))
        assert torch.equal(got.top_token_ids, torch.topk(raw, 2, dim=-1).indices)
    # the dense bool form still gives the same draw
    dense = torch.ones(8, vocab, dtype=torch.bool)
    if constrained:
        dense[constrained] = ~disallowed_from_bitmask(bitmask, vocab)
    assert torch.equal(Sampler()(logits, rows, allowed=dense).token_ids, want.token_ids)


def test_sampler_leaves_logits_alone_unless_allowed_to_overwrite():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 100, generator=gen)
    bitmask = random_bitmask(4, 100, gen, density=0.5)
    kept = logits.clone()
    Sampler()(logits, _rows(4), allowed=TokenBitmask(bitmask, (0, 1, 2, 3)))
    assert torch.equal(logits, kept)
    Sampler()(logits, _rows(4), allowed=TokenBitmask(bitmask, (0, 1, 2, 3)), overwrite_logits=True)
    want = xgrammar_masked(kept, bitmask, [0, 1, 2, 3])
    want[[0, 0, 3, 3], [3, 7, 3, 7]] = float("-inf")  # rows 0 and 3 ban tokens 3 and 7
    assert torch.equal(logits, want)


@pytest.mark.parametrize("overwrite", [False, True])
def test_verify_with_packed_mask_equals_pre_masked_logits(overwrite):
    vocab = 500
    gen = torch.Generator().manual_seed(11)
    ks = [2, 0, 3]
    n = sum(1 + k for k in ks)
    logits = torch.randn(n, vocab, generator=gen) * 2
    constrained = [0, 1, 2, 4, 5, 7]  # packed rows; the second sequence and one draft row are free
    bitmask = random_bitmask(len(constrained), vocab, gen, density=0.7)
    pre = xgrammar_masked(logits, bitmask, constrained)
    base = 0
    inputs = []
    for s, k in enumerate(ks):
        rows = [
            RowParams(temperature=0.0 if s == 1 else 1.0, top_p=0.95, seed=s, position=base + j)
            for j in range(1 + k)
        ]
        drafts = torch.argmax(pre[base : base + k], dim=-1).tolist() if k else []
        q = torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1) if k and s != 1 else None
        inputs.append(VerifyInput(rows, drafts, q, [-1] * (1 + k)))
        base += 1 + k

    def run(lg, mask, ow):
        return verify_logits(DraftVerifier(), lg, inputs, mask, overwrite_logits=ow).result

    want = run(pre.clone(), None, False)
    got = run(logits.clone(), TokenBitmask(bitmask, tuple(constrained)), overwrite)
    assert got.emitted == want.emitted
    assert got.num_accepted == want.num_accepted
    assert torch.equal(got.accept_probs, want.accept_probs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_masks_on_cuda_logits_match_cpu():
    """Host bitmasks go to the logits' device; masking, sampling and verification give the CPU result."""
    vocab = 129280
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, vocab, generator=gen) * 3
    bitmask = random_bitmask(5, vocab, gen, density=0.9)
    rows = (0, 2, 3, 5, 6)
    cpu = logits.clone()
    apply_token_bitmask_(cpu, TokenBitmask(bitmask, rows))
    for contiguous in (False, True):
        r = tuple(range(5)) if contiguous else rows
        want = logits.clone()
        apply_token_bitmask_(want, TokenBitmask(bitmask, r))
        gpu = logits.cuda()
        apply_token_bitmask_(gpu, TokenBitmask(bitmask, r))  # bitmask stays on the host
        assert torch.equal(gpu.cpu(), want)
        gpu = logits.cuda()
        apply_token_bitmask_(gpu, TokenBitmask(bitmask.cuda(), r))
        assert torch.equal(gpu.cpu(), want)
    assert torch.equal(cpu, xgrammar_masked(logits, bitmask, list(rows)))
    sampler_rows = _rows(8)
    want = Sampler()(logits, sampler_rows, allowed=TokenBitmask(bitmask, rows)).token_ids
    for ow in (False, True):
        got = Sampler()(logits.cuda(), sampler_rows, allowed=TokenBitmask(bitmask, rows), overwrite_logits=ow)
        assert got.token_ids.device.type == "cuda"
        assert torch.equal(got.token_ids.cpu(), want)
    got = Sampler()(logits.cuda().bfloat16(), sampler_rows, allowed=TokenBitmask(bitmask, rows)).token_ids
    want = Sampler()(logits.bfloat16(), sampler_rows, allowed=TokenBitmask(bitmask, rows)).token_ids
    assert torch.equal(got.cpu(), want)
