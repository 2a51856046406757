"""Greedy verification against step-by-step greedy decoding of an independent n-gram target."""

import pytest
import torch
from deepinfer_spec import ConfidenceScheduler, DraftVerifier, StepTimeCurve
from deepinfer_spec.toy import Drafter, NGramModel, greedy_reference, run_toy_decode

PROMPTS = [[1, 2, 3], [4], [7, 7], [0, 5, 6, 1]]


@pytest.mark.parametrize("nextn", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_greedy_with_drafts_equals_plain_greedy(nextn, alpha):
    target = NGramModel(vocab=11, order=2, seed=3, scale=1.0)
    drafter = Drafter(target, alpha=alpha, seed=9)
    run = run_toy_decode(target, drafter, PROMPTS, max_new_tokens=24, nextn=nextn)
    for prompt, out in zip(PROMPTS, run.outputs):
        assert out == greedy_reference(target, prompt, 24)
    if nextn:
        assert run.stats.total_verified > 0  # drafts were really verified


def test_greedy_with_varlen_equals_plain_greedy():
    target = NGramModel(vocab=11, order=2, seed=4, scale=1.0)
    curve = StepTimeCurve([4, 8, 12, 16, 24], [1.0, 1.3, 1.6, 2.5, 4.0])
    scheduler = ConfidenceScheduler(nextn=5, curve=curve)
    run = run_toy_decode(target, Drafter(target, 0.7, seed=2), PROMPTS, 30, nextn=5, scheduler=scheduler)
    for prompt, out in zip(PROMPTS, run.outputs):
        assert out == greedy_reference(target, prompt, 30)
    lengths = {k for plan in run.plans for k in plan.num_verify}
    assert len(lengths) > 1  # the rule really chose different verification lengths


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("nextn", [1, 3, 5])
def test_oracle_drafter_is_always_accepted(nextn, temperature):
    target = NGramModel(vocab=9, order=2, seed=5)
    run = run_toy_decode(
        target,
        Drafter(target, alpha=1.0),
        PROMPTS,
        max_new_tokens=1 + 4 * (1 + nextn),
        nextn=nextn,
        temperature=temperature,
        seeds=[11, 12, 13, 14],
    )
    assert run.stats.total_accepted == run.stats.total_verified > 0
    # After the first (draft-free) step every step emits 1 + nextn tokens per request.
    assert run.stats.steps == 5
    assert run.stats.acceptance_rate_per_position() == [1.0] * nextn


def test_greedy_verify_packed_batch_by_hand():
    # Three requests with 2, 0 and 3 drafts; targets are one-hot-ish logits so the argmax is clear.
    vocab = 6
    argmaxes = [[3, 1, 4], [2], [5, 0, 0, 1]]  # per request, per target row
    rows = torch.full((3 + 1 + 4, vocab), -1.0)
    flat = [t for req in argmaxes for t in req]
    rows[torch.arange(len(flat)), torch.tensor(flat)] = 2.0
    # req0: both drafts match -> bonus 4; req1: no drafts -> 2; req2: 5 matches, 3 != 0 -> correction 0
    # (its third draft 0 would match its row, but the prefix rule discards it).
    drafts = [3, 1, 5, 3, 0]
    result = DraftVerifier().verify(
        rows, drafts, [2, 0, 3], seeds=[0, 0, 0], base_positions=[5, 6, 7], greedy=[True] * 3
    )
    assert result.num_accepted == [2, 0, 1]
    assert result.final_tokens == [4, 2, 0]
    assert result.emitted == [[3, 1, 4], [2], [5, 0]]
    assert result.row_accepted.tolist() == [
        True,
        True,
        True,
        False,
        True,
    ]  # the row test, before the prefix rule
    assert result.prefix_accepted().tolist() == [True, True, True, False, False]
    assert result.accept_probs.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_padding_draft_is_rejected():
    rows = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])
    result = DraftVerifier().verify(rows, [-1], [1], seeds=[0], base_positions=[0], greedy=[True])
    assert result.num_accepted == [0] and result.emitted == [[1]]


@pytest.mark.parametrize("greedy", [True, False])
def test_golden_tokens_force_rows_and_decide_acceptance(greedy):
    gen = torch.Generator().manual_seed(4)
    vocab = 6
    target = torch.softmax(torch.randn(4 + 3, vocab, generator=gen), -1)  # req0: 3 drafts, req1: 2
    q = torch.softmax(torch.randn(5, vocab, generator=gen), -1)
    drafts = [2, 3, 4, 1, 1]
    golden = [[2, 3, 0, 5], [-1, 1, 4]]  # req0: d1, d2 match, d3 != 0 -> emits 0; req1 row 0 free
    result = DraftVerifier().verify(
        target,
        drafts,
        [3, 2],
        seeds=[1, 2],
        base_positions=[4, 4],
        greedy=[greedy] * 2,
        draft_probs=q,
        golden=golden,
    )
    assert result.num_accepted[0] == 2 and result.emitted[0] == [2, 3, 0]
    free = DraftVerifier().verify(
        target[4:], drafts[3:], [2], seeds=[2], base_positions=[4], greedy=[greedy], draft_probs=q[3:]
    )
    if free.num_accepted[0] == 0:  # row 0 is not forced: same outcome as without golden tokens
        assert result.emitted[1] == free.emitted[0]
    else:  # d2 = 1 matches golden row 1; the fresh row 2 is forced to 4
        assert result.emitted[1] == [1, 1, 4]
    with pytest.raises(ValueError, match="golden"):
        DraftVerifier().verify(
            target[4:], drafts[3:], [2], seeds=[2], base_positions=[4], greedy=[True], golden=[[9]]
        )
