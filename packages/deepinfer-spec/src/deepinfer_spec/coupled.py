"""Coupled verification of sampled drafts: every emitted token is the plain sampler's own draw.

The plain sampler (`deepinfer_model.sampling.Sampler`) draws the token at position n of a request by
inverse CDF: u = stream_uniform(seed, n, SAMPLE) picks the token whose cumulative interval (float64,
vocabulary order) contains u * total. Coupled verification draws the target token of every verify row j
(the token at position base + j) in exactly that way, from exactly those weights, and accepts draft
d_{j+1} iff it equals row j's draw (prefix rule); the final token is the draw of the first row whose draft
was not accepted (or of the fresh row). So the token emitted at each position is the one the plain step
would have emitted there: the same weights (accepted drafts are the earlier draws, so row j's context,
penalties and grammar state are the plain step's) and the same uniform. The output distribution is
therefore exactly the target's, because it IS the plain step-by-step sampling process; drafts only decide
how many of its draws one forward yields, and whether a step verifies drafts (the draft policy's choice,
which depends on measured times and on the batch) cannot change a single token.

Agreement: the drafter draws its draft for position n by inverse CDF of its own distribution q with the
same uniform (`draft_stream_seed`: the target's seed, at the token's position, purpose SAMPLE). The
target's method fixes the target draw as a function of u and p alone; the drafter knows u and q, and the
token whose q-interval holds u is the one whose p-interval holds it when q is near p: always, for q = p.
The probability that the two draws agree is the total overlap of the two partitions of [0, 1) into
cumulative intervals, Σ_x |[P(x−1), P(x)) ∩ [Q(x−1), Q(x))| (`coupled_agreement`), at most rejection
sampling's Σ_x min(p, q) (the best any coupling reaches): the intervals of x start where the masses of
every earlier token in vocabulary order add up, so a difference between p and q shifts the intervals of
all later tokens, and a token narrower than that shift rarely agrees. Rejection sampling (`sampling=
"rejection"` of `DraftVerifier`, DEEPINFER_SPEC_SAMPLED_VERIFY=rejection) keeps the larger acceptance at
the price of tokens that depend on which steps verified drafts (benchmarks/spec/bench_coupled_acceptance.py
measures both).
"""

from __future__ import annotations

import torch

from .random_stream import DRAFT_SEED_OFFSET

SAMPLED_VERIFY_MODES = ("coupled", "rejection")


def draft_stream_seed(seed: int, coupled: bool) -> int:
    """Seed of a request's draft-sampling stream (drafts are drawn at their token's position, purpose
    SAMPLE): coupled, the target's own seed, so a draft and the plain draw at its position share the
    uniform; for rejection sampling, the seed shifted by DRAFT_SEED_OFFSET, so that drafts are independent
    of the accept and residual draws (spec §5.4)."""
    return int(seed) if coupled else int(seed) + DRAFT_SEED_OFFSET


def coupled_agreement(p: torch.Tensor, q: torch.Tensor, overwrite_p: bool = False) -> torch.Tensor:
    """P(inverse-CDF draws from p and from q with one shared uniform pick the same token), per row
    (float64 [rows] for [rows, V] inputs): the overlap of the cumulative intervals in vocabulary order.
    Rows need not be normalised; a row of zero mass agrees with nothing (0). `overwrite_p`: p is a
    float64 scratch copy of the caller's (e.g. rows gathered for this call), worked on in place: a
    [rows, V] allocation less, which on the CPU costs as much as a pass over the rows."""
    p, q = p.double(), q.double()
    p_total, q_total = p.sum(-1, keepdim=True), q.sum(-1, keepdim=True)
    ok = (p_total > 0) & (q_total > 0)
    hi_p = p.cumsum_(-1) if overwrite_p else torch.cumsum(p, -1)
    hi_p.div_(torch.where(p_total > 0, p_total, 1.0))
    hi_q = torch.cumsum(q, -1).div_(torch.where(q_total > 0, q_total, 1.0))
    # token x's interval is [hi(x - 1), hi(x)), the first one's starts at 0: the overlap of x is
    # min(hi_p, hi_q)(x) - max(hi_p, hi_q)(x - 1), written over hi_p (no shifted copies of the rows)
    starts = torch.maximum(hi_p[..., :-1], hi_q[..., :-1])
    overlap = torch.minimum(hi_p, hi_q, out=hi_p)
    overlap[..., 1:] -= starts
    overlap = overlap.clamp_(min=0.0).sum(-1)
    return torch.where(ok.squeeze(-1), overlap.clamp(0.0, 1.0), 0.0)
