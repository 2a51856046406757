"""The sampler draws from exactly the distribution the spec's transform defines.

Reference: a float64, one-row-at-a-time Python implementation of temperature -> top-p -> top-k ->
min-p written from the spec text; the sampler's empirical frequencies over many independent seeds
must pass a chi-square goodness-of-fit test against it.
"""

import math

import pytest
import torch
from deepinfer_model.sampling import RowParams, Sampler

LOGITS = [2.0, 1.5, 1.5, 0.3, -0.2, 0.9, -1.0, 0.0, 1.1, -3.0]
N_DRAWS = 20_000


def reference_probs(logits, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0):
    scaled = [x / temperature for x in logits]
    m = max(scaled)
    w = [math.exp(x - m) for x in scaled]
    z = sum(w)
    p = [x / z for x in w]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))  # stable: lower id first on ties
    keep = set()
    ahead = 0.0
    for rank, i in enumerate(order):
        if (top_p >= 1.0 or ahead <= top_p) and (top_k < 0 or rank < top_k):
            keep.add(i)
        ahead += p[i]
    pmax = max(p)
    keep = {i for i in keep if p[i] >= min_p * pmax}
    kept_mass = sum(p[i] for i in keep)
    return [p[i] / kept_mass if i in keep else 0.0 for i in range(len(p))]


def chi_square_pvalue(counts, probs, n):
    support = [i for i, q in enumerate(probs) if q > 0]
    stat = sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in support)
    dof = len(support) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(top_k=3),
    dict(top_p=0.7),
    dict(min_p=0.3),
    dict(temperature=1.4, top_p=0.9, top_k=5),
    dict(temperature=0.8, min_p=0.1, top_k=6),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_frequencies_match_reference(cfg):
    ref = reference_probs(LOGITS, **cfg)
    rows = [RowParams(seed=s, position=11, **cfg) for s in range(N_DRAWS)]
    logits = torch.tensor([LOGITS] * N_DRAWS)
    tokens = Sampler()(logits, rows).token_ids
    counts = torch.bincount(tokens, minlength=len(LOGITS)).tolist()
    # filtered tokens are never drawn
    assert all(c == 0 for c, q in zip(counts, ref) if q == 0), (counts, ref)
    assert chi_square_pvalue(counts, ref, N_DRAWS) > 1e-4, (counts, [round(q * N_DRAWS) for q in ref])


def test_positions_of_one_seed_are_independent_draws():
    # one request decoding many positions must also see the right distribution
    ref = reference_probs(LOGITS, temperature=0.9)
    rows = [RowParams(temperature=0.9, seed=1234, position=p) for p in range(N_DRAWS)]
    tokens = Sampler()(torch.tensor([LOGITS] * N_DRAWS), rows).token_ids
    counts = torch.bincount(tokens, minlength=len(LOGITS)).tolist()
    assert chi_square_pvalue(counts, ref, N_DRAWS) > 1e-4


def test_top_k_tie_keeps_lower_id():
    # tokens 1 and 2 tie; with top_k=2 only ids 0 and 1 survive
    assert reference_probs(LOGITS, top_k=2)[2] == 0.0
    rows = [RowParams(seed=s, top_k=2) for s in range(2000)]
    tokens = Sampler()(torch.tensor([LOGITS] * 2000), rows).token_ids
    assert set(tokens.tolist()) == {0, 1}


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    out = Sampler()(logits, [RowParams(temperature=0.0, seed=s) for s in (1, 2)])
    assert out.token_ids.tolist() == [1, 0]


def test_banned_tokens_and_allowed_mask_are_never_drawn():
    logits = torch.tensor([LOGITS] * 3000)
    rows = [RowParams(seed=s, banned_token_ids=(0, 1)) for s in range(3000)]
    allowed = torch.ones(3000, len(LOGITS), dtype=torch.bool)
    allowed[:, 5] = False
    tokens = Sampler()(logits, rows, allowed=allowed).token_ids
    assert not set(tokens.tolist()) & {0, 1, 5}
    greedy = Sampler()(torch.tensor([LOGITS]), [RowParams(temperature=0.0, banned_token_ids=(0,))])
    assert greedy.token_ids.tolist() == [1]


def test_logprobs_are_raw_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    rows = [
        RowParams(temperature=t, seed=i, logprobs=n)
        for i, (t, n) in enumerate([(0, 0), (1, 3), (0.5, 5), (2, None)])
    ]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits.double(), dim=-1)
    chosen = ref.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs.double(), chosen, rtol=0, atol=1e-5)
    assert out.top_token_ids.shape == (4, 5)
    expected_top = torch.argsort(ref, dim=-1, descending=True, stable=True)[:, :5]
    assert torch.equal(out.top_token_ids, expected_top)
    torch.testing.assert_close(out.top_logprobs.double(), ref.gather(1, expected_top), rtol=0, atol=1e-5)
