"""The adaptive draft policy: its plan against brute force over every set of drafting sequences and every
per-sequence prefix of verified drafts, the calibration and cost model against direct computations, and
its behaviour with an always-wrong and an always-right drafter."""

import itertools
import math
import random

import numpy as np
import pytest
from deepinfer_spec import (
    AcceptanceCalibration,
    ConfidenceScheduler,
    DraftPolicy,
    LinearCost,
    StepTimeCurve,
    cumulative_rates,
)


def random_curve(rng: random.Random, max_tokens: int) -> StepTimeCurve:
    sizes = sorted(rng.sample(range(1, max_tokens + 3), rng.randint(1, min(6, max_tokens + 2))))
    if sizes[-1] < max_tokens:
        sizes.append(max_tokens)
    ms, t = [], rng.uniform(0.5, 2.0)
    for _ in sizes:
        t += rng.uniform(0.0, 1.5)
        ms.append(t)
    return StepTimeCurve(sizes, ms, rng.choice(["bucket", "linear"]))


def brute_force_plan(rates, num_seqs, curve, draft_ms, plain=lambda rows: 0.0, verify=None):
    """Max over every allocation k_i <= len(rates_i) (k_i = 0: sequence i does not draft) of expected
    tokens / (forward of num_seqs + Σ k tokens + the sampler of a plain step (Σ k = 0) or of a
    verification step + draft_ms if anyone drafts)."""
    verify = verify or plain
    best = -1.0
    for ks in itertools.product(*[range(len(r) + 1) for r in rates]):
        tokens = num_seqs + sum(ks)
        baseline = curve.baseline_ms(tokens)
        if baseline is None:
            continue
        expected = num_seqs + sum(sum(r[:k]) for r, k in zip(rates, ks))
        sampler = verify(tokens) if any(ks) else plain(tokens)
        best = max(best, expected / (baseline + sampler + (draft_ms if any(ks) else 0.0)))
    return best


def test_plan_is_the_brute_force_optimum_with_a_fixed_draft_cost():
    """A draft forward that costs the same for any number of drafting sequences (a batched forward
    bound by its weight reads): the plan's expected tokens per ms equal the best of every allocation."""
    rng = random.Random(11)
    checked = 0
    for _ in range(200):
        nextn, n_cand = rng.randint(1, 3), rng.randint(1, 4)
        num_seqs = n_cand + rng.randint(0, 2)
        curve = random_curve(rng, num_seqs * (1 + nextn))
        policy = DraftPolicy(nextn, ConfidenceScheduler(nextn, curve))
        draft_ms = rng.choice([0.0, rng.uniform(0.0, 3.0)])
        if draft_ms:
            for m in (1, 2, 3):
                policy.record_draft_time(m, draft_ms)  # one size per sample: a + b·m fits b = 0
            assert policy.cost.get(5) == pytest.approx(draft_ms)
        cands = [(i, rng.randint(1, nextn)) for i in range(n_cand)]
        for seq_id, k in cands:  # some measured history per sequence and for the batch
            for _ in range(rng.randint(0, 3)):
                conf = [rng.random() for _ in range(k)]
                verified = rng.randint(0, k)
                policy.record(seq_id, conf, verified, rng.randint(0, verified))
        plain = verify = None
        if rng.random() < 0.5:  # measured sampler times: a verification step costs more per row
            a, b = rng.uniform(0, 2), rng.uniform(0, 0.5)
            for rows in (1, 4):
                policy.record_step_time(rows, a + b * rows, verified=False)
                policy.record_step_time(rows, 2 * a + 3 * b * rows, verified=True)
            plain, verify = policy.plain_sampler.get, policy.verify_sampler.get
            assert verify(7) == pytest.approx(2 * a + 21 * b)
        rates = [policy.expected_rates(s, k) for s, k in cands]
        plan = policy.plan(cands, num_seqs)
        best = brute_force_plan(rates, num_seqs, curve, draft_ms, *(() if plain is None else (plain, verify)))
        if plan.predicted_ms is None:
            assert best < 0 and not any(plan.draft)
            continue
        assert plan.expected_tokens / plan.predicted_ms == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked > 150


def test_only_worthwhile_sequences_draft_and_the_others_back_off_then_probe():
    flat = StepTimeCurve([64], [10.0])  # verifying costs nothing extra: only the draft forward costs
    # (no probe budget: this checks the backoff schedule itself)
    policy = DraftPolicy(2, ConfidenceScheduler(2, flat), min_backoff=2, max_backoff=8, probe_budget=None)
    policy.record_draft_time(1, 2.0)
    policy.record_draft_time(2, 4.0)  # 2 ms per drafting sequence
    assert policy.cost.get(3) == pytest.approx(6.0)
    for _ in range(6):  # sequence 0 is always right, sequence 1 always wrong
        policy.record(0, [0.5, 0.5], 2, 2)
        policy.record(1, [0.5, 0.5], 2, 0)
    plan = policy.plan([(0, 2), (1, 2)], 2)
    assert plan.draft == [True, False] and plan.probe == [False, False]
    # sequence 1 backs off for 2 plans, probes on the third, verifying every draft
    assert policy.plan([(0, 2), (1, 2)], 2).draft == [True, False]
    probe = policy.plan([(0, 2), (1, 2)], 2)
    assert probe.draft == [True, True] and probe.probe == [False, True]
    assert policy.verify_counts([0, 1], [[0.01, 0.01], [0.01, 0.01]], 2)[1] == 2
    policy.record(1, [0.01, 0.01], 2, 0)  # the probe fails: the interval doubles
    assert policy.plan([(0, 2), (1, 2)], 2).draft == [True, False]
    drafted = [policy.plan([(0, 2), (1, 2)], 2).draft[1] for _ in range(4)]
    assert drafted == [False, False, False, True]
    assert policy.summary()["policy_probe_seq_steps"] == 2


def test_verify_counts_are_the_varlen_rule_on_calibrated_rates():
    rng = random.Random(4)
    for _ in range(50):
        nextn = rng.randint(1, 4)
        curve = random_curve(rng, 4 * (1 + nextn))
        policy = DraftPolicy(nextn, ConfidenceScheduler(nextn, curve))
        for _ in range(30):  # a miscalibrated head: every confidence bin learns its outcomes
            k = rng.randint(1, nextn)
            policy.calibration.record([rng.random() for _ in range(k)], k, rng.randint(0, k))
        sampler = lambda rows: 0.0  # noqa: E731
        if rng.random() < 0.5:
            policy.record_step_time(2, 1.0, verified=True)
            policy.record_step_time(6, 3.0, verified=True)  # 0.5 ms per verified row
            sampler = policy.verify_sampler.get
        conf = [[rng.random() for _ in range(rng.randint(1, nextn))] for _ in range(rng.randint(1, 3))]
        num_seqs = len(conf) + rng.randint(0, 1)
        counts = policy.verify_counts(list(range(len(conf))), conf, num_seqs)
        rates = [cumulative_rates(policy.calibration.calibrated(c)) for c in conf]
        best = -1.0
        for ks in itertools.product(*[range(len(r) + 1) for r in rates]):
            baseline = curve.baseline_ms(num_seqs + sum(ks))
            if baseline is not None:
                ms = baseline + (sampler(num_seqs + sum(ks)) if any(ks) else 0.0)
                best = max(best, (num_seqs + sum(sum(r[:k]) for r, k in zip(rates, ks))) / ms)
        got = curve.baseline_ms(num_seqs + sum(counts))
        if got is None:
            assert counts == [0] * len(conf)
            continue
        got += sampler(num_seqs + sum(counts)) if any(counts) else 0.0
        assert (num_seqs + sum(sum(r[:k]) for r, k in zip(rates, counts))) / got == pytest.approx(best)


def test_calibration_against_direct_counts():
    cal = AcceptanceCalibration(num_bins=4, prior_weight=2.0, decay=0.5)
    assert cal.calibrated([0.3, 1.0]) == [0.3, 1.0]  # unmeasured: the head as it is
    cal.record([0.9, 0.8, 0.1], num_verified=3, num_accepted=1)  # 0.9 accepted, 0.8 rejected, 0.1 untested
    cal.record([0.9, 0.2], num_verified=1, num_accepted=0)
    # bin 3 (0.75..1): decayed (1 tested, 1 accepted) -> 0.5/0.5, then +1 tested, 0 accepted
    tested3, accepted3 = 0.5 * 2 + 1, 0.5 * 1
    assert cal.calibrated([0.9])[0] == pytest.approx((accepted3 + 2 * 0.9) / (tested3 + 2))
    assert cal.calibrated([0.1])[0] == pytest.approx(0.1)  # the untested draft left bin 0 alone


def test_cost_model_fits_a_line_and_falls_back_to_per_sequence_time():
    cost = LinearCost()
    assert cost.get(3) == 0.0
    for m in (1, 2, 4, 8):
        cost.add(m, 1.5 + 0.25 * m)
    assert cost.get(16) == pytest.approx(1.5 + 0.25 * 16)
    single = LinearCost()
    for ms in (2.0, 3.0, 10.0):
        single.add(2, ms)
    assert single.get(4) == pytest.approx(np.median([1.0, 1.5, 5.0]) * 4)


def reference_cost(samples, m: int) -> float:
    """LinearCost's definition from scratch in float64: least squares through (size, ms) by the normal
    equations; a fixed cost where the slope is negative, the line through the origin where the intercept
    is, the median time per unit while there is one size."""
    sizes = np.array([s for s, _ in samples], dtype=np.float64)
    ms = np.array([t for _, t in samples], dtype=np.float64)
    if len(set(sizes.tolist())) < 2:
        return float(np.median(ms / sizes)) * m
    n, sx, sy = len(sizes), sizes.sum(), ms.sum()
    slope = (n * (sizes * ms).sum() - sx * sy) / (n * (sizes * sizes).sum() - sx * sx)
    intercept = (sy - slope * sx) / n
    if slope < 0:
        return float(ms.mean())
    if intercept < 0:
        return float((sizes * ms).sum() / (sizes * sizes).sum()) * m
    return float(intercept + slope * m)


def test_cost_model_follows_every_measurement():
    """The fit is made once per measurement (a plan asks for hundreds of sizes in between): every answer
    is the definition's over the samples so far, in the window, after each add, for growing, flat and
    falling costs and a single size."""
    rng = random.Random(7)
    for shape in ("growing", "falling", "fixed", "single"):
        cost = LinearCost(window=16)
        seen = []
        for _ in range(40):
            m = 8 if shape == "single" else rng.randint(1, 64)
            ms = {"growing": 0.5 + 0.02 * m, "falling": 3.0 - 0.01 * m, "fixed": 1.0, "single": 0.1 * m}[
                shape
            ]
            ms = max(0.0, ms + rng.uniform(-0.05, 0.05))
            cost.add(m, ms)
            seen = (seen + [(m, ms)])[-16:]
            for ask in (1, 7, 64, 300):
                assert cost.get(ask) == pytest.approx(reference_cost(seen, ask), rel=1e-9, abs=1e-12)
        assert cost.get(0) == 0.0
    cost.add(0, 5.0)  # not a measurement: the fit stays
    assert cost.get(7) == pytest.approx(reference_cost(seen, 7), rel=1e-9)


def test_step_times_priced_at_once_are_the_scalar_ones_bit_for_bit():
    """A plan prices every total of drafts in one array call (`step_ms_array`, `charged_array`): each value
    is `step_ms`'s / `charged`'s exactly, NaN where that says None, for bucket and linear curves, with and
    without extrapolation, before and after sampler and host measurements."""
    rng = random.Random(11)
    for trial in range(60):
        curve = random_curve(rng, rng.randint(1, 40))
        curve.extrapolate = rng.random() < 0.5
        policy = DraftPolicy(3, ConfidenceScheduler(3, curve))
        for _ in range(rng.randint(0, 6) if trial % 3 else 0):
            m = rng.randint(1, 50)
            policy.record_step_time(m, rng.uniform(0, 2), verified=rng.random() < 0.5)
            policy.record_host_time(m, rng.uniform(0, 2), verified=rng.random() < 0.5)
            policy.rule.forward_estimator.add(m, rng.uniform(-0.01, 0.05))
        num_seqs = rng.randint(1, 20)
        tokens = np.arange(num_seqs, num_seqs + 60)
        priced = policy.step_ms_array(tokens, num_seqs)
        for n, got in zip(tokens.tolist(), priced.tolist()):
            want = policy.step_ms(n, num_seqs)
            assert (want is None and np.isnan(got)) or got == want, (trial, n, got, want)
        sizes, baselines = curve.charged_array(tokens)
        for n, size, base in zip(tokens.tolist(), sizes.tolist(), baselines.tolist()):
            want = curve.charged(n)
            assert (want is None and np.isnan(base)) or (size, base) == want, (trial, n, size, base, want)


def simulate(accept: bool, steps: int, num_seqs: int = 4, nextn: int = 3):
    """A batch decoding `steps` steps with a drafter whose drafts are all right / all wrong (and a head
    that says 0.9 either way): drafted sequences per step."""
    curve = StepTimeCurve([1, 64], [10.0, 10.0 + 0.2 * 63], mode="linear")
    policy = DraftPolicy(nextn, ConfidenceScheduler(nextn, curve))
    drafted_per_step = []
    for _ in range(steps):
        plan = policy.plan([(s, nextn) for s in range(num_seqs)], num_seqs)
        ids = [s for s, d in enumerate(plan.draft) if d]
        if ids:
            policy.record_draft_time(len(ids), 1.0 + 0.5 * len(ids))
            conf = [[0.9] * nextn for _ in ids]
            for s, k in zip(ids, policy.verify_counts(ids, conf, num_seqs)):
                policy.record(s, conf[0], k, k if accept else 0)
        drafted_per_step.append(len(ids))
    return drafted_per_step, policy


def test_an_always_wrong_drafter_stops_drafting_and_an_oracle_keeps_full_length():
    wrong, policy = simulate(accept=False, steps=200)
    assert wrong[0] == 4  # the warm-up drafts and measures
    late = wrong[40:]
    probes = sum(late)
    assert probes <= 4 * math.ceil(math.log2(200 / 4))  # only doubling probes remain
    assert sum(1 for d in late if d == 0) >= 0.9 * len(late)
    assert policy.summary()["policy_draft_fraction"] < 0.1
    right, policy = simulate(accept=True, steps=50)
    assert right == [4] * 50 and policy.skipped == 0
    conf = [[0.9] * 3] * 4
    assert policy.verify_counts(list(range(4)), conf, 4) == [3] * 4


def wrong_drafter_run(probe_budget, steps=600, num_seqs=64, nextn=5, fixed_ms=100.0):
    """A batch of `num_seqs` sequences whose drafts are never accepted, a draft forward with a high fixed
    cost (`fixed_ms`, host work, + 0.1 ms a sequence) and a 13 ms plain step; sequences join at staggered
    times so their probes fall due at different steps. Returns (steps with probes, the predicted time the
    drafting added as a share of the plain steps' time, the policy)."""
    curve = StepTimeCurve([1, 512], [13.0, 13.0 + 0.01 * 511], mode="linear", extrapolate=True)
    policy = DraftPolicy(nextn, ConfidenceScheduler(nextn, curve), probe_budget=probe_budget)
    probe_steps, extra_ms, plain_ms = 0, 0.0, 0.0
    for step in range(steps):
        live = min(num_seqs, 1 + step // 2)
        plan = policy.plan([(s, nextn) for s in range(live)], live)
        ids = [s for s, d in enumerate(plan.draft) if d]
        plain_ms += policy.step_ms(live, live)
        if ids:
            draft_ms = fixed_ms + 0.1 * len(ids)
            policy.record_draft_time(len(ids), draft_ms)
            conf = [[0.5] * nextn for _ in ids]
            counts = policy.verify_counts(ids, conf, live)
            extra_ms += draft_ms + policy.step_ms(live + sum(counts), live) - policy.step_ms(live, live)
            for s, k in zip(ids, counts):
                policy.record(s, conf[0], k, 0)
            probe_steps += any(plan.probe)
    return probe_steps, extra_ms / plain_ms, policy


def test_probes_of_a_never_right_drafter_stay_within_the_budget_and_run_together():
    unbounded_steps, unbounded_cost, _ = wrong_drafter_run(None)
    steps, cost, policy = wrong_drafter_run(0.05)
    # without a budget, staggered probes make a large share of steps pay the draft forward's fixed cost
    assert unbounded_steps > 100 and unbounded_cost > 1.0
    # with it, the probes that fall due wait and go together; after the warm-up the cost is the budget's
    s = policy.summary()
    assert s["policy_probe_ms_fraction"] <= 0.05 + 110.0 / policy.plain_ms  # (one probe step over at most)
    assert s["policy_deferred_probe_seq_plans"] > 0 and s["policy_probe_seq_steps"] > 0
    assert steps <= unbounded_steps / 5
    assert cost < unbounded_cost / 4


def test_a_probe_budget_does_not_hold_back_a_drafter_that_pays():
    drafted, policy = simulate(accept=True, steps=50)
    assert drafted == [4] * 50 and policy.summary()["policy_deferred_probe_seq_plans"] == 0


def test_bad_arguments_are_named():
    rule = ConfidenceScheduler(2, StepTimeCurve([4], [1.0]))
    with pytest.raises(ValueError, match="needs a varlen rule"):
        DraftPolicy(2, ConfidenceScheduler(2))
    with pytest.raises(ValueError, match="max_backoff must be >= min_backoff"):
        DraftPolicy(2, rule, min_backoff=8, max_backoff=4)
    with pytest.raises(ValueError, match="seq_decay must lie in"):
        DraftPolicy(2, rule, seq_decay=0.0)
    policy = DraftPolicy(2, rule)
    with pytest.raises(ValueError, match=r"drafts for 0 must be an integer in \[1, nextn=2\]"):
        policy.plan([(0, 3)], 1)
    with pytest.raises(ValueError, match="num_seqs must be >= len"):
        policy.plan([(0, 1), (1, 1)], 1)
    with pytest.raises(ValueError, match="num_accepted <= num_verified"):
        policy.record(0, [0.5], 1, 2)


def test_extrapolating_curve_continues_the_last_line():
    curve = StepTimeCurve([4, 8], [1.0, 3.0], mode="linear", extrapolate=True)
    assert curve.charged(16) == (16, 3.0 + 0.5 * 8)
    flat_end = StepTimeCurve([4, 8], [3.0, 2.0], extrapolate=True)
    assert flat_end.charged(20) == (20, 2.0)  # never below the last time
    assert StepTimeCurve([4], [2.0], extrapolate=True).charged(9) == (9, 2.0)
    assert StepTimeCurve([4, 8], [1.0, 3.0]).charged(9) is None


def test_plan_is_the_brute_force_optimum_with_the_host_work_verification_adds():
    """Measured host work per step (outside forward, sampler and draft forward) as a + b·rows, apart for
    plain and verification steps: a verification step of T rows over S sequences costs
    max(0, verify(T) - plain(S)) more (the whole of verify(T) while no plain step is measured), and the
    plan is still the best of every allocation."""
    rng = random.Random(23)
    checked = clamped = 0
    for _ in range(200):
        nextn, n_cand = rng.randint(1, 3), rng.randint(1, 4)
        num_seqs = n_cand + rng.randint(0, 2)
        curve = random_curve(rng, num_seqs * (1 + nextn))
        policy = DraftPolicy(nextn, ConfidenceScheduler(nextn, curve))
        draft_ms = rng.uniform(0.0, 1.0)
        policy.record_draft_time(1, draft_ms)
        policy.record_draft_time(3, draft_ms)
        cands = [(i, rng.randint(1, nextn)) for i in range(n_cand)]
        for seq_id, k in cands:
            for _ in range(rng.randint(0, 3)):
                verified = rng.randint(0, k)
                policy.record(seq_id, [rng.random() for _ in range(k)], verified, rng.randint(0, verified))
        av, bv = rng.uniform(0, 10), rng.uniform(0, 2)
        for rows in (2, 5):
            policy.record_host_time(rows, av + bv * rows, verified=True)
        ap, bp = rng.uniform(0, 10), rng.uniform(0, 2)
        plain_measured = rng.random() < 0.8
        if plain_measured:
            for rows in (1, 3):
                policy.record_host_time(rows, ap + bp * rows, verified=False)
        else:
            ap = bp = 0.0

        def added(tokens, av=av, bv=bv, ap=ap, bp=bp, num_seqs=num_seqs):
            return max(0.0, av + bv * tokens - (ap + bp * num_seqs))

        clamped += added(num_seqs * (1 + nextn)) == 0.0
        rates = [policy.expected_rates(s, k) for s, k in cands]
        plan = policy.plan(cands, num_seqs)
        best = brute_force_plan(rates, num_seqs, curve, draft_ms, verify=added)
        if plan.predicted_ms is None:
            assert best < 0 and not any(plan.draft)
            continue
        assert plan.expected_tokens / plan.predicted_ms == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked > 150 and clamped > 10  # (some verification steps cost less host work than plain ones)


def host_run(verify_host_ms: float | None, steps: int = 60, plain_host_ms: float = 2.0):
    """One sequence, nextn 3, whose first draft is always accepted and second always rejected (2 tokens
    per verification step against 1 per plain step), a 10 ms step (+ 0.2 ms a verified token), a 1 ms
    draft forward; every step's host work recorded as the engine records it: `plain_host_ms` for a plain
    step, `verify_host_ms` more for a verification step (None: host work never measured). Returns the
    drafting steps and the policy."""
    nextn = 3
    curve = StepTimeCurve([1, 64], [10.0, 10.0 + 0.2 * 63], mode="linear")
    policy = DraftPolicy(nextn, ConfidenceScheduler(nextn, curve))
    drafted = []
    for _ in range(steps):
        plan = policy.plan([(0, nextn)], 1)
        counts = [0]
        if plan.draft[0]:
            policy.record_draft_time(1, 1.0)
            conf = [0.9] * nextn
            counts = policy.verify_counts([0], [conf], 1)
            policy.record(0, conf, counts[0], min(counts[0], 1))
        if verify_host_ms is not None:
            verified = counts[0] > 0
            policy.record_host_time(
                1 + counts[0], plain_host_ms + (verify_host_ms if verified else 0.0), verified
            )
        drafted.append(plan.draft[0] and not plan.probe[0])
    return drafted, policy


def test_the_host_work_of_verification_backs_off_a_drafter_that_pays_only_without_it():
    free, _ = host_run(None)
    assert all(free)  # 2 tokens in about 12 ms against 1 in 10: it pays
    costly, policy = host_run(20.0)
    assert costly[0]  # the first step drafts and measures
    assert sum(costly[10:]) == 0  # then 2 tokens in 32 ms against 1 in 10: only probes draft
    s = policy.summary()
    assert s["policy_probe_seq_steps"] >= 1 and s["policy_draft_fraction"] < 0.2
    assert policy.verify_host_ms(4, 1) == pytest.approx(20.0)  # against the measured plain steps
    cheap, policy = host_run(4.0)
    assert all(cheap)  # 2 tokens in about 16 ms: it still pays
    assert policy.verify_host_ms(3, 1) == pytest.approx(6.0)  # no plain step measured: all of it


def test_the_host_work_is_not_charged_before_a_verification_step_is_measured():
    curve = StepTimeCurve([1, 64], [10.0, 10.0 + 0.2 * 63], mode="linear")
    measured = DraftPolicy(2, ConfidenceScheduler(2, curve))
    fresh = DraftPolicy(2, ConfidenceScheduler(2, curve))
    for rows in (1, 4):
        measured.record_host_time(rows, 50.0 * rows, verified=False)  # plain steps only
    for policy in (measured, fresh):
        policy.record_draft_time(2, 1.0)
        policy.record(0, [0.5, 0.5], 2, 1)
    assert measured.step_ms(6, 3) == fresh.step_ms(6, 3) == pytest.approx(10.0 + 0.2 * 5)
    assert measured.plan([(0, 2), (1, 2)], 3) == fresh.plan([(0, 2), (1, 2)], 3)
    # once a verification step is measured, plain steps' host work is what it is charged against
    measured.record_host_time(6, 400.0, verified=True)
    assert measured.verify_host_ms(6, 3) == pytest.approx(400.0 - 150.0)
    assert measured.step_ms(6, 3) == pytest.approx(10.0 + 0.2 * 5 + 250.0)
    assert measured.step_ms(3, 3) == pytest.approx(10.0 + 0.2 * 2)  # a plain step: no host work charged
