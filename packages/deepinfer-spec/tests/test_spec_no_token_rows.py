"""Target rows that allow no token (every token masked) in verification: the draft of such a row is
rejected, a request whose final row is one has no final token (`VerifyResult.no_token`) and emits only
its accepted drafts, and the other requests of the batch verify exactly as alone. A draft whose q row
is zero (the drafter had no token there) is rejected and its row draws from p, as a plain draw would.
"""

import pytest
import torch
from deepinfer_spec import VERIFY_ROW_STRIDE, DraftVerifier, Purpose, stream_uniform

NEG = float("-inf")
VOCAB = 6


def _logits(argmaxes: list[int | None]) -> torch.Tensor:
    """Greedy rows: a clear argmax per row, or -inf everywhere (None: every token masked)."""
    rows = torch.full((len(argmaxes), VOCAB), -1.0)
    for r, t in enumerate(argmaxes):
        if t is None:
            rows[r] = NEG
        else:
            rows[r, t] = 2.0
    return rows


def _greedy(logits, drafts, ks):
    n = len(ks)
    return DraftVerifier().verify(
        logits, drafts, ks, seeds=[0] * n, base_positions=[0] * n, greedy=[True] * n
    )


def test_greedy_rows_without_a_token_stop_their_request_alone():
    # req0: both drafts match, bonus 4. req1: d1 matches row 0; row 1 allows nothing, and its draft 0 (the
    # argmax of a row of -inf) must not be accepted. req2: its first row allows nothing.
    logits = _logits([3, 1, 4, 2, None, 5, None, 0])
    got = _greedy(logits, [3, 1, 2, 0, 0], [2, 2, 1])
    assert got.num_accepted == [2, 1, 0]
    assert got.final_tokens == [4, -1, -1]
    assert got.emitted == [[3, 1, 4], [2], []]
    assert got.no_token == [False, True, True]
    assert got.num_emitted == [3, 1, 0]
    assert got.row_accepted.tolist() == [True, True, True, False, False]
    alone = _greedy(logits[:3], [3, 1], [2])
    assert alone.emitted == got.emitted[:1] and alone.no_token == [False]
    assert got.accepted_device.tolist() == [2, 1, 0] and got.final_device.tolist() == [4, -1, -1]


def test_a_forced_token_does_not_pass_a_row_without_a_token():
    logits = _logits([2, None, 5])
    got = DraftVerifier().verify(
        logits, [2, 3], [2], seeds=[0], base_positions=[0], greedy=[True], golden=[[2, 3, 5]]
    )
    assert got.num_accepted == [1] and got.no_token == [True] and got.emitted == [[2]]


def _probs(rows: list[list[float] | None]) -> torch.Tensor:
    return torch.tensor([r if r is not None else [0.0] * VOCAB for r in rows], dtype=torch.float64)


def naive_inverse_cdf(weights: list[float], u: float) -> int:
    """Naive float64 reference draw (vocabulary order)."""
    total, acc = sum(weights), 0.0
    for t, w in enumerate(weights):
        acc += w
        if u * total < acc:
            return t
    return max(t for t, w in enumerate(weights) if w > 0)


P = [0.1, 0.2, 0.3, 0.1, 0.2, 0.1]
ONE_HOT_2 = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_sampled_rows_without_a_token_stop_their_request_alone():
    # req0: a normal request; req1: d1 certain (p = q one-hot), row 1 has no mass; req2: row 0 has no mass.
    target = _probs([P, P, ONE_HOT_2, None, P, None, P])
    q = _probs([P, ONE_HOT_2, P, P])
    kw = dict(seeds=[11, 12, 13], base_positions=[4, 7, 9], greedy=[False] * 3)
    got = DraftVerifier().verify(target, [1, 2, 3, 0], [1, 2, 1], draft_probs=q, **kw)
    assert got.num_accepted[1:] == [1, 0]
    assert got.final_tokens[1:] == [-1, -1] and got.no_token == [False, True, True]
    assert got.emitted[1:] == [[2], []]
    alone = DraftVerifier().verify(
        target[:2], [1], [1], draft_probs=q[:1], seeds=[11], base_positions=[4], greedy=[False]
    )
    assert alone.emitted == got.emitted[:1] and alone.no_token == [False]


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_a_draft_with_a_zero_q_row_is_rejected_and_its_row_draws_from_p(sampling):
    # p(t) > 0 for the draft, which a zero q would accept by the ratio test (or by matching the row's
    # plain draw, coupled): it must be rejected.
    target = _probs([P, P])
    q = _probs([None])
    drew_the_draft = 0
    for seed in range(20):
        got = DraftVerifier(sampling=sampling).verify(
            target, [4], [1], draft_probs=q, seeds=[seed], base_positions=[3], greedy=[False]
        )
        assert got.num_accepted == [0] and got.no_token == [False]
        if sampling == "rejection":
            u = stream_uniform(seed, 3 + 0 * VERIFY_ROW_STRIDE, Purpose.RESIDUAL)
        else:  # the plain sampler's draw at row 0's position
            u = stream_uniform(seed, 3, Purpose.SAMPLE)
        assert got.final_tokens == [naive_inverse_cdf(P, u)]
        drew_the_draft += got.final_tokens == [4]
    assert sampling == "rejection" or drew_the_draft > 0  # coupled: rejected even where it matched


@pytest.mark.parametrize("bad", [float("nan"), -0.5])
def test_rows_that_are_not_distributions_still_raise(bad):
    target = _probs([P, P])
    target[1, 2] = bad
    kw = dict(seeds=[0], base_positions=[0], greedy=[False])
    with pytest.raises(ValueError, match="target_probs rows must be finite and >= 0"):
        DraftVerifier().verify(target, [1], [1], draft_probs=_probs([P]), **kw)
    q = _probs([P])
    q[0, 1] = bad
    with pytest.raises(ValueError, match="draft_probs rows must be finite and >= 0"):
        DraftVerifier().verify(_probs([P, P]), [1], [1], draft_probs=q, **kw)


def test_select_keeps_the_chosen_requests():
    logits = _logits([3, 1, 4, 2, None, 5, None, 0])
    got = _greedy(logits, [3, 1, 2, 0, 0], [2, 2, 1])
    part = got.select([2, 0])
    assert part.num_drafts == [1, 2] and part.num_accepted == [0, 2]
    assert part.final_tokens == [-1, 4] and part.emitted == [[], [3, 1, 4]] and part.no_token == [True, False]
    assert part.row_accepted.tolist() == [False, True, True]
    assert part.accepted_device.tolist() == [0, 2] and part.final_device.tolist() == [-1, 4]
