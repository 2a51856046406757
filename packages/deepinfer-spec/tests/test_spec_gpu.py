"""Verification on CUDA tensors gives exactly the CPU result (same streams, same float64 rule)."""

import pytest
import torch
from deepinfer_spec import DraftVerifier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_verification_matches_cpu():
    gen = torch.Generator().manual_seed(0)
    vocab, ks = 1000, [5, 0, 3, 5, 1, 2]
    greedy = [False, True, False, True, False, False]
    rows = sum(ks) + len(ks)
    target = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, -1)
    q = torch.softmax(torch.randn(sum(ks), vocab, generator=gen) * 3, -1)
    verify_rows = [d + i for i, k in enumerate(ks) for d in range(sum(ks[:i]), sum(ks[:i]) + k)]
    q = 0.1 * q + 0.9 * target[verify_rows]  # a good drafter: some accepted, some rejected
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1)
    for i in (1, 3):  # greedy requests: draft the target's argmax except at their last draft
        first = sum(ks[:i])
        rows_i = verify_rows[first : first + ks[i]]
        drafts[first : first + ks[i]] = target[rows_i].argmax(-1)
        if ks[i]:
            drafts[first + ks[i] - 1] = (drafts[first + ks[i] - 1] + 1) % vocab
    kwargs = dict(seeds=[3, 1, 4, 1, 5, 9], base_positions=[10, 20, 30, 40, 50, 60], greedy=greedy)
    cpu = DraftVerifier().verify(target, drafts, ks, draft_probs=q, **kwargs)
    gpu = DraftVerifier().verify(target.cuda(), drafts.cuda(), ks, draft_probs=q.cuda(), **kwargs)
    assert gpu.emitted == cpu.emitted and gpu.num_accepted == cpu.num_accepted
    assert torch.equal(gpu.row_accepted, cpu.row_accepted)
    assert torch.allclose(gpu.accept_probs, cpu.accept_probs, rtol=1e-12, atol=1e-12)
    assert 0 < sum(cpu.num_accepted) < sum(ks)
