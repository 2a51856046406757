"""The draft policy's questions for a loop that runs plain steps ahead: `would_draft` against brute force
(a copy of the policy making the real plans and looking whether any of them lets a candidate draft or
changes a candidate's history), and `advance` against the real plan where nobody would draft, over many
policy states reached through the policy's own plans and outcomes."""

import copy
import random
from collections import deque

import numpy as np
import pytest
from deepinfer_spec import ConfidenceScheduler, DraftPolicy, StepTimeCurve


class TickingClock:
    """Seconds that advance by a fixed tick at every reading (each timed plan: a step of that length)."""

    def __init__(self, tick_s: float) -> None:
        self.now, self.tick_s = 0.0, tick_s

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


def random_policy(rng: random.Random) -> tuple[DraftPolicy, list[int]]:
    """A policy after a random history: plans over random subsets of a few sequences, each drafting
    sequence's outcome drawn from its own acceptance quality, measured draft and sampler times, the
    odd sequence leaving; half of them timing their steps (wall ratios in their charges)."""
    nextn = rng.randint(1, 4)
    ms = np.cumsum([rng.uniform(0.5, 2.0)] + [rng.uniform(0.0, 1.5) for _ in range(4)]).tolist()
    curve = StepTimeCurve([1, 4, 16, 32, 64], ms, rng.choice(["bucket", "linear"]))
    min_backoff = rng.choice([1, 2, 4])
    policy = DraftPolicy(
        nextn,
        ConfidenceScheduler(nextn, curve),
        min_backoff=min_backoff,
        max_backoff=min_backoff * rng.choice([1, 4, 16]),
        probe_budget=rng.choice([None, 0.01, 0.05, 0.5, 5.0]),
        clock=rng.choice([None, TickingClock(rng.uniform(0.0005, 0.01))]),
    )
    seqs = list(range(rng.randint(1, 6)))
    quality = {s: rng.choice([0.0, 0.0, 0.2, 0.9]) for s in seqs}
    for _ in range(rng.randint(0, 60)):
        cands = [(s, rng.randint(1, nextn)) for s in rng.sample(seqs, rng.randint(1, len(seqs)))]
        num_seqs = len(cands) + rng.randint(0, 2)
        plan = policy.plan(cands, num_seqs)
        drafting = [c for c, d in zip(cands, plan.draft) if d]
        if drafting:
            policy.record_draft_time(len(drafting), rng.uniform(0.0, 4.0))
        for s, k in drafting:
            conf = [rng.random() for _ in range(k)]
            verified = k if plan.probe[cands.index((s, k))] else rng.randint(0, k)
            accepted = 0
            while accepted < verified and rng.random() < quality[s]:
                accepted += 1
            policy.record(s, conf, verified, accepted)
        if rng.random() < 0.3:
            policy.record_step_time(num_seqs, rng.uniform(0.0, 2.0), verified=bool(drafting))
        if rng.random() < 0.03:
            policy.remove(rng.choice(seqs))
    return policy, seqs


MEMOS = {"_fit", "_cached"}  # fits made from the samples beside them when first asked for: not state


def snapshot(value):
    """Everything a policy holds, as comparable plain values (floats exactly)."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.tolist())
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, deque)):
        return [snapshot(v) for v in value]
    if hasattr(value, "__dict__"):
        return (type(value).__name__, snapshot({k: v for k, v in vars(value).items() if k not in MEMOS}))
    return value


def histories(policy: DraftPolicy, seq_ids) -> dict:
    return {s: snapshot(policy._seqs[s]) for s in seq_ids if s in policy._seqs}


def brute_force_would_draft(policy: DraftPolicy, cands, num_seqs: int, lookahead: int) -> bool:
    """`lookahead` real plans on a copy: does any let a candidate draft or change a candidate's history
    (a sequence it weighed: a new one gets one, a member is picked or backs off, an evaluated probe is
    weighed again)?"""
    policy = copy.deepcopy(policy)
    ids = [s for s, _ in cands]
    for _ in range(lookahead):
        before = histories(policy, ids)
        plan = policy.plan(cands, num_seqs)
        if any(plan.draft) or histories(policy, ids) != before:
            return True
    return False


def test_would_draft_is_the_real_plans_answer_and_advance_is_that_plan():
    rng = random.Random(7)
    answers = {True: 0, False: 0}
    due_but_held_back = 0
    for _ in range(400):
        policy, seqs = random_policy(rng)
        for _ in range(4):
            ids = rng.sample(seqs, rng.randint(1, len(seqs)))
            if rng.random() < 0.1:
                ids.append(100 + rng.randint(0, 3))  # a sequence the policy does not know yet
            cands = [(s, rng.randint(1, policy.nextn)) for s in ids]
            num_seqs = len(cands) + rng.randint(0, 2)
            lookahead = rng.choice([1, 1, 2, 3, 6])
            before = snapshot(policy)
            answer = policy.would_draft(ids, num_seqs, lookahead)
            assert snapshot(policy) == before  # asking changes nothing
            assert answer == brute_force_would_draft(policy, cands, num_seqs, lookahead)
            answers[answer] += 1
            at = policy.plans + lookahead
            if not answer and any(
                s in policy._seqs and policy._seqs[s].backoff and at >= policy._seqs[s].next_probe
                for s in ids
            ):
                due_but_held_back += 1
            if policy.would_draft(ids, num_seqs):
                continue
            planned, advanced = copy.deepcopy(policy), copy.deepcopy(policy)
            plan = planned.plan(cands, num_seqs)
            advanced.advance(ids, num_seqs)
            assert not any(plan.draft)
            assert snapshot(advanced) == snapshot(planned)
    # both answers, and probes that were due but held back by the budget, are covered
    assert answers[True] > 200 and answers[False] > 200 and due_but_held_back > 20, (
        answers,
        due_but_held_back,
    )


def test_advance_keeps_whom_the_plan_would_weigh_for_the_next_plan():
    """Where someone would draft, `advance` counts a plan in which nobody drafts and leaves every
    candidate's history as it was: a new sequence stays unknown, a member stays a member, a due probe
    stays due (and the next plan still runs it)."""
    rng = random.Random(3)
    checked = 0
    for _ in range(300):
        policy, seqs = random_policy(rng)
        ids = rng.sample(seqs, rng.randint(1, len(seqs))) + [100]
        num_seqs = len(ids)
        if policy.measuring_plain_steps(num_seqs) or policy.measuring_plain_steps(num_seqs, 1):
            assert not policy.would_draft(ids, num_seqs)  # a plan that measures plain steps weighs no one
            continue
        assert policy.would_draft(ids, num_seqs)  # (the unknown sequence 100)
        before, plans, skipped = histories(policy, ids), policy.plans, policy.skipped
        policy.advance(ids, num_seqs)
        assert histories(policy, ids) == before and 100 not in policy._seqs
        assert policy.plans == plans + 1 and policy.skipped == skipped + len(ids)
        assert policy.would_draft(ids, num_seqs)
        checked += 1
    assert checked > 250


def test_bad_arguments_are_named():
    policy = DraftPolicy(2, ConfidenceScheduler(2, StepTimeCurve([1, 8], [1.0, 2.0], "linear")))
    with pytest.raises(ValueError, match="num_seqs must be an integer >= len"):
        policy.would_draft([1, 2], 1)
    with pytest.raises(ValueError, match="lookahead must be an integer >= 1"):
        policy.would_draft([1], 1, lookahead=0)
    with pytest.raises(ValueError, match="num_seqs must be an integer >= len"):
        policy.advance([1, 2], 1)
    assert not policy.would_draft([], 0)
