"""Sampled verification, coupled (the default) and rejection sampling: distribution preservation, exact
acceptance probabilities, seeded reproducibility, batch independence."""

import itertools
import math

import pytest
import torch
from deepinfer_spec import (
    ConfidenceScheduler,
    DraftVerifier,
    StepTimeCurve,
    stream_uniform,
)
from deepinfer_spec.toy import Drafter, NGramModel, run_toy_decode

Z_1E4 = 3.719  # standard normal upper quantile for p = 1e-4


def chi2_critical(dof: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square upper quantile."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def exact_sequence_probs(target: NGramModel, prompt, length, temperature):
    probs = {}
    for seq in itertools.product(range(target.vocab), repeat=length):
        ctx, p = list(prompt), 1.0
        for tok in seq:
            p *= float(target.probs([ctx], temperature)[0, tok])
            ctx.append(tok)
        probs[seq] = p
    return probs


def chi_square(counts, probs, n):
    """Pearson statistic over cells with expected count >= 5 plus one pooled cell for the rest."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for seq, p in probs.items():
        expected, observed = n * p, counts.get(seq, 0)
        if expected >= 5:
            stat += (observed - expected) ** 2 / expected
            dof += 1
        else:
            pooled_obs += observed
            pooled_exp += expected
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    return stat, dof


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
@pytest.mark.parametrize("varlen", [False, True])
def test_sampled_outputs_with_drafts_follow_the_target_distribution(varlen, sampling):
    vocab, length, n, temperature = 5, 3, 3000, 0.9
    target = NGramModel(vocab=vocab, order=2, seed=21, scale=1.0)
    drafter = Drafter(target, alpha=0.3, seed=8)  # q differs from p: rejections and residuals happen
    prompt = [1, 2]
    # Varlen: a curve on which verifying costs little per token, so lengths differ between steps.
    curve = StepTimeCurve([n, 2 * n, 3 * n], [10.0, 12.0, 30.0], mode="linear") if varlen else None
    run = run_toy_decode(
        target,
        drafter,
        [prompt] * n,
        max_new_tokens=length,
        nextn=2,
        temperature=temperature,
        seeds=range(n),
        scheduler=ConfidenceScheduler(2, curve),
        verifier=DraftVerifier(sampling=sampling),
    )
    if varlen:
        assert (
            0
            < sum(sum(p.num_verify) for p in run.plans[1:])
            < 2 * sum(len(p.num_verify) for p in run.plans[1:])
        )
    stats = run.stats
    assert 0 < stats.total_accepted < stats.total_verified  # both accept and reject paths were used
    counts = {}
    for out in run.outputs:
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    probs = exact_sequence_probs(target, prompt, length, temperature)
    stat, dof = chi_square(counts, probs, n)
    assert stat < chi2_critical(dof), (stat, dof)

    # Power check: the same samples are clearly NOT distributed like the drafter's own chain, so the
    # test above would catch a verifier that accepted drafts blindly.
    mix_probs = {}
    for seq in probs:
        ctx, p = list(prompt), 1.0
        for tok in seq:
            pt = target.probs([ctx], temperature)[0]
            po = drafter.own.probs([ctx], temperature)[0]
            p *= float(0.3 * pt[tok] + 0.7 * po[tok])
            ctx.append(tok)
        mix_probs[seq] = p
    stat_q, dof_q = chi_square(counts, mix_probs, n)
    assert stat_q > 3 * chi2_critical(dof_q)


def naive_coupled_agreement(p: list[float], q: list[float]) -> float:
    """P(inverse-CDF draws from p and q with one shared uniform agree), by a float64 loop over the
    cumulative intervals in vocabulary order (the independent reference of `coupled_agreement`)."""
    sp, sq = sum(p), sum(q)
    lo_p = lo_q = total = 0.0
    for a, b in zip(p, q):
        hi_p, hi_q = lo_p + a / sp, lo_q + b / sq
        total += max(0.0, min(hi_p, hi_q) - max(lo_p, lo_q))
        lo_p, lo_q = hi_p, hi_q
    return total


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
@pytest.mark.parametrize(
    "p, q",
    [
        ([0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]),
        ([0.6, 0.4, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]),  # top-k-filtered target: drafts 2, 3 never pass
    ],
)
def test_single_step_first_token_distribution_with_residual(p, q, sampling):
    """One verification step, many seeds: the first emitted token ~ p even though q is far from p."""
    expected_rate = (
        naive_coupled_agreement(p, q) if sampling == "coupled" else sum(min(a, b) for a, b in zip(p, q))
    )
    p = torch.tensor(p, dtype=torch.float64)
    q = torch.tensor(q, dtype=torch.float64)
    n = 4000
    target = p.repeat(2 * n, 1)  # rows [x, d1] per request
    drafts = []
    for seed in range(n):  # the draft is sampled from q with the verifier's draft stream
        if sampling == "coupled":  # the target's own uniform at the draft's position (row 0: base 3)
            u = stream_uniform(seed, 3)
        else:  # a stream of its own
            u = stream_uniform(seed + 99, 0)
        drafts.append(
            int(torch.searchsorted(torch.cumsum(q, 0), torch.tensor([u]), right=True)[0].clamp(max=3))
        )
    result = DraftVerifier(sampling=sampling).verify(
        target,
        drafts,
        [1] * n,
        seeds=list(range(n)),
        base_positions=[3] * n,
        greedy=[False] * n,
        draft_probs=q.repeat(n, 1),
    )
    first = torch.tensor([e[0] for e in result.emitted])
    counts = torch.bincount(first, minlength=4).double()
    support = p > 0
    assert counts[~support].sum() == 0
    stat = float(((counts[support] - n * p[support]) ** 2 / (n * p[support])).sum())
    assert stat < chi2_critical(int(support.sum()) - 1)
    # The estimated acceptance probability is the exact one: the overlap Σ min(p, q) (rejection), the
    # overlap of the cumulative intervals (coupled).
    assert torch.allclose(result.accept_probs, torch.full((n,), expected_rate, dtype=torch.float64))
    # The empirical acceptance rate matches it.
    rate, overlap = sum(result.num_accepted) / n, expected_rate
    assert abs(rate - overlap) < 4 * math.sqrt(overlap * (1 - overlap) / n)


def test_seeded_runs_are_reproducible_and_seed_dependent():
    target = NGramModel(vocab=8, order=2, seed=2, scale=1.0)
    drafter = Drafter(target, alpha=0.5)
    kwargs = dict(max_new_tokens=20, nextn=3, temperature=1.0)
    a = run_toy_decode(target, drafter, [[1], [2]], seeds=[7, 8], **kwargs)
    b = run_toy_decode(target, drafter, [[1], [2]], seeds=[7, 8], **kwargs)
    c = run_toy_decode(target, drafter, [[1], [2]], seeds=[70, 80], **kwargs)
    assert a.outputs == b.outputs
    assert a.outputs != c.outputs
    # A request's tokens do not depend on what else is in the batch.
    alone = run_toy_decode(target, drafter, [[2]], seeds=[8], **kwargs)
    assert alone.outputs[0] == a.outputs[1]


def test_verification_of_a_request_is_independent_of_its_batch():
    gen = torch.Generator().manual_seed(0)
    vocab = 7
    target = torch.softmax(torch.randn(4 + 3, vocab, generator=gen), -1)  # req A: 3 drafts, req B: 2
    q = torch.softmax(torch.randn(5, vocab, generator=gen), -1)
    drafts = [1, 2, 3, 4, 5]
    both = DraftVerifier().verify(
        target, drafts, [3, 2], seeds=[5, 6], base_positions=[10, 20], greedy=[False, True], draft_probs=q
    )
    alone = DraftVerifier().verify(
        target[4:], drafts[3:], [2], seeds=[6], base_positions=[20], greedy=[True], draft_probs=q[3:]
    )
    first = DraftVerifier().verify(
        target[:4], drafts[:3], [3], seeds=[5], base_positions=[10], greedy=[False], draft_probs=q[:3]
    )
    assert both.emitted == first.emitted + alone.emitted
    assert both.num_accepted == first.num_accepted + alone.num_accepted


def test_zero_drafts_reproduce_the_model_sampler():
    """With no drafts the fresh row is exactly a plain decode sample (same stream, same rule)."""
    sampling = pytest.importorskip("deepinfer_model.sampling")
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    rows = [
        sampling.RowParams(temperature=0.7, top_k=20, seed=s, position=p)
        for s, p in zip(range(6), range(3, 9))
    ]
    expected = sampling.Sampler()(logits, rows).token_ids.tolist()
    probs = sampling.filtered_probs(logits, rows)
    result = DraftVerifier().verify(
        probs, [], [0] * 6, seeds=list(range(6)), base_positions=list(range(3, 9)), greedy=[False] * 6
    )
    assert result.final_tokens == expected


def test_accept_tests_use_each_rows_own_uniform_and_counts_stay_on_the_device():
    """Rejection sampling: a naive per-row reference of the sampled accept test (U * q(t) < p(t), U the row's ACCEPT draw at
    base + j * VERIFY_ROW_STRIDE, prefix rule) gives the verifier's accepted counts; the device copies of
    the counts and final tokens equal the host ones."""
    from deepinfer_spec import VERIFY_ROW_STRIDE, Purpose

    gen = torch.Generator().manual_seed(4)
    vocab, ks, seeds, bases = 6, [3, 2, 4, 1], [3, 2**64 - 9, 77, 5], [11, 0, 400, 9]
    target = torch.softmax(torch.randn(sum(ks) + len(ks), vocab, generator=gen, dtype=torch.float64), -1)
    verify_rows = [sum(ks[:i]) + i + j for i, k in enumerate(ks) for j in range(k)]
    q = (
        0.5 * target[verify_rows]
        + 0.5 * torch.softmax(torch.randn(sum(ks), vocab, generator=gen), -1).double()
    )
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
    result = DraftVerifier(sampling="rejection").verify(
        target, drafts, ks, seeds=seeds, base_positions=bases, greedy=[False] * 4, draft_probs=q
    )
    want, d = [], 0
    for i, k in enumerate(ks):
        row0 = sum(ks[:i]) + i
        a = 0
        for j in range(k):
            u = stream_uniform(seeds[i], bases[i] + j * VERIFY_ROW_STRIDE, Purpose.ACCEPT)
            t = drafts[d + j]
            if a == j and u * float(q[d + j, t]) < float(target[row0 + j, t]):
                a += 1
        want.append(a)
        d += k
    assert result.num_accepted == want
    assert 0 < sum(want) < sum(ks)  # both outcomes occur
    assert result.accepted_device.tolist() == result.num_accepted
    assert result.final_device.tolist() == result.final_tokens
