"""Coupled sampled verification (the default): every emitted token is the plain sampler's draw at its
position, so seeded outputs do not depend on which steps verify drafts; acceptance against the exact
probabilities of both schemes (coupled: overlap of cumulative intervals; rejection: Σ min(p, q))."""

import math

import pytest
import torch
from deepinfer_spec import (
    ConfidenceScheduler,
    DraftVerifier,
    Purpose,
    StepTimeCurve,
    coupled_agreement,
    draft_position,
    draft_stream_seed,
    stream_uniform,
)
from deepinfer_spec.toy import Drafter, NGramModel, run_toy_decode

from .test_spec_no_token_rows import naive_inverse_cdf
from .test_spec_sampling_verify import naive_coupled_agreement


def _draw(weights: torch.Tensor, u: float) -> int:
    """Naive float64 inverse-CDF draw in vocabulary order (first token whose cumulative mass exceeds u * total)."""
    return naive_inverse_cdf(weights.double().tolist(), u)


KINDS = [
    dict(temperature=0.8),
    dict(temperature=1.1, top_k=6),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=0.0),
    dict(temperature=0.9, min_p=0.05),
]


def _check_batch(sampling, trial: int) -> tuple[int, int]:
    """One batch of the five KINDS of requests verifying drafts; asserts every emitted token is the
    Sampler's. Returns (drafts accepted, drafts verified)."""
    gen = torch.Generator().manual_seed(trial)
    vocab, ks = 40, [3, 4, 2, 3, 0]
    seeds = [5 + trial, 2**63 + 11 * trial, 90, 7 * trial, 31]
    bases = [12 + trial, 3, 40 + 2 * trial, 8, 19]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen) * 1.5
    rows = [
        sampling.RowParams(seed=seeds[i], position=bases[i] + j, **KINDS[i])
        for i, k in enumerate(ks)
        for j in range(k + 1)
    ]
    plain = sampling.Sampler()(logits, rows).token_ids.tolist()  # each row alone is its plain step
    target = logits.double().clone()
    sampled = [r for r, row in enumerate(rows) if not row.greedy]
    target[sampled] = sampling.filtered_probs(logits[sampled], [rows[r] for r in sampled]).double()
    # Drafts from q = a mix of the row's p and noise, drawn with the coupled draft stream
    drafts, q_rows, r = [], [], 0
    for i, k in enumerate(ks):
        for j in range(k):
            p = torch.softmax(target[r + j], -1) if rows[r].greedy else target[r + j]
            q = 0.9 * p + 0.1 * torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
            # draft j is the candidate for position base + j: the next step's draft_position after the
            # token at base - 1, with nothing accepted (draft_position(base - 1, 0, j))
            u = stream_uniform(draft_stream_seed(seeds[i], True), draft_position(bases[i] - 1, 0, j))
            drafts.append(_draw(q, u))
            q_rows.append(q)
        r += k + 1
    result = DraftVerifier().verify(
        target,
        drafts,
        ks,
        seeds=seeds,
        base_positions=bases,
        greedy=[not KINDS[i]["temperature"] for i in range(len(ks))],
        draft_probs=torch.stack(q_rows),
    )
    d, r = 0, 0
    for i, k in enumerate(ks):
        a = result.num_accepted[i]
        assert result.emitted[i] == drafts[d : d + a] + [plain[r + a]], (trial, i)
        # accepted exactly while the draft equals its row's plain token
        matches = [drafts[d + j] == plain[r + j] for j in range(k)]
        assert a == (matches.index(False) if False in matches else k), (trial, i)
        d, r = d + k, r + k + 1
    return sum(result.num_accepted), sum(ks)


def test_every_emitted_token_is_the_plain_samplers_draw_at_its_position():
    """Batches of sampled requests (temperature, top-k, top-p, min-p) and a greedy one verify drafts that
    are sometimes right: each emitted token equals `deepinfer_model.Sampler`'s token for that row's logits
    at that position and seed, and a draft is accepted exactly when it equals it."""
    sampling = pytest.importorskip("deepinfer_model.sampling")
    accepted, verified = map(sum, zip(*(_check_batch(sampling, trial) for trial in range(12))))
    assert 0.2 * verified < accepted < 0.9 * verified  # both outcomes, at every depth of the prefix


def test_coupled_agreement_is_the_naive_float64_overlap():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, 30, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(6, 30, generator=gen, dtype=torch.float64) * 2, -1)
    p[1, :20] = 0.0  # filtered rows (top-k) and unnormalised weights
    q[2] *= 3.0
    got = coupled_agreement(p, q)
    want = [naive_coupled_agreement(a.tolist(), b.tolist()) for a, b in zip(p, q)]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(coupled_agreement(p, p), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-12)
    # the maximal coupling (rejection sampling's acceptance) bounds it
    assert (
        got <= torch.minimum(p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)).sum(-1) + 1e-12
    ).all()
    assert coupled_agreement(torch.zeros(1, 30), q[:1]).item() == 0.0
    # working in a scratch copy of p gives the same bits, and leaves q alone
    q_before = q.clone()
    assert torch.equal(coupled_agreement(p.clone(), q, overwrite_p=True), got)
    assert torch.equal(q, q_before)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_toy_outputs_with_drafts_equal_the_drafts_off_outputs(alpha):
    """The whole decode loop: seeded sampled outputs are the drafts-off outputs token for token, for every
    number of drafts and for varlen verification lengths (which depend on the batch); rejection sampling's
    are not (same distribution, other tokens)."""
    target = NGramModel(vocab=12, order=2, seed=5, scale=1.5)
    drafter = Drafter(target, alpha=alpha, seed=4)
    prompts, seeds = [[1, 2], [3], [4, 5, 6], [7]], [11, 12, 13, 2**64 - 1]
    kw = dict(max_new_tokens=16, temperature=0.9, seeds=seeds)
    plain = run_toy_decode(target, None, prompts, nextn=0, **kw).outputs
    curve = StepTimeCurve([4, 8, 16], [10.0, 12.0, 30.0], mode="linear")
    runs = {}
    for nextn in (1, 3):
        for name, scheduler in (
            ("all", ConfidenceScheduler(nextn)),
            ("varlen", ConfidenceScheduler(nextn, curve)),
        ):
            run = run_toy_decode(target, drafter, prompts, nextn=nextn, scheduler=scheduler, **kw)
            assert run.outputs == plain, (nextn, name)
            assert run.stats.total_accepted > 0
            runs[(nextn, name)] = run
    # alpha = 1 (q = p): the coupled draft is the target's own draw, accepted every time
    if alpha == 1.0:
        assert all(r.stats.total_accepted == r.stats.total_verified for r in runs.values())
    rejection = run_toy_decode(
        target, drafter, prompts, nextn=3, verifier=DraftVerifier(sampling="rejection"), **kw
    )
    assert rejection.outputs != plain


def _acceptance(p: torch.Tensor, q: torch.Tensor, sampling: str, n: int) -> float:
    """Fraction of n seeded one-draft verifications (draft ~ q by the verifier's draft stream) accepted."""
    coupled = sampling == "coupled"
    base = 5
    cdf = torch.cumsum(q, 0)
    drafts = []
    for seed in range(n):
        u = stream_uniform(draft_stream_seed(seed, coupled), base, Purpose.SAMPLE)
        drafts.append(
            int(
                torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[
                    0
                ].clamp(max=len(q) - 1)
            )
        )
    result = DraftVerifier(sampling=sampling).verify(
        p.repeat(2 * n, 1),
        drafts,
        [1] * n,
        seeds=list(range(n)),
        base_positions=[base] * n,
        greedy=[False] * n,
        draft_probs=q.repeat(n, 1),
    )
    return sum(result.num_accepted) / n


@pytest.mark.parametrize("noise", [0.0, 0.05, 0.3])
def test_acceptance_of_both_schemes_matches_the_exact_probabilities(noise):
    """q = p with small log-perturbations: each scheme's accepted fraction matches its exact acceptance
    probability (float64), coupled <= rejection, equal (1) at q = p. The cost of coupling for realistic
    distributions is measured by benchmarks/spec/bench_coupled_acceptance.py."""
    gen = torch.Generator().manual_seed(7)
    vocab, n = 30, 3000
    logits = torch.randn(vocab, generator=gen, dtype=torch.float64) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits + noise * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    exact = {
        "coupled": naive_coupled_agreement(p.tolist(), q.tolist()),
        "rejection": float(torch.minimum(p, q).sum()),
    }
    assert exact["coupled"] <= exact["rejection"] + 1e-12
    for sampling, want in exact.items():
        got = _acceptance(p, q, sampling, n)
        if noise == 0.0:
            assert want == pytest.approx(1.0) and got == 1.0
        else:
            assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / n), (sampling, got, want)
