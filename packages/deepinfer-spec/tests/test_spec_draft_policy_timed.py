"""The draft policy on the wall clock: steps it plans are timed, and what a kind of step (with drafts or
without) costs beyond its predicted parts is charged to that kind's choices. A simulated engine whose
steps take a known wall time, against the same policy without a clock."""

import random

import numpy as np
import pytest
from deepinfer_spec import ConfidenceScheduler, DraftPolicy, StepTimeCurve


class SimulatedClock:
    """Seconds that pass only when the simulated engine says so (a copy of a policy copies its clock)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wait_ms(self, ms: float) -> None:
        self.now += ms / 1e3


def run(
    accept_rate,
    extra_draft_ms,
    timed,
    steps=300,
    num_seqs=8,
    nextn=3,
    seed=0,
    clock=None,
    extra_plain_ms=0.0,
):
    """`num_seqs` sequences decoding `steps` steps on a flat 10 ms step (a GPU's small batch: a verified
    draft costs the forward nothing more) with a 0.5 ms draft forward, each draft accepted with
    `accept_rate`. A step with drafts takes `extra_draft_ms` more on the wall clock than its parts (a
    synchronous step in a loop that otherwise runs ahead), a plain one `extra_plain_ms` more. Returns
    the sequences drafting per step and the policy."""
    rng = random.Random(seed)
    curve = StepTimeCurve([1, 512], [10.0, 10.0], mode="linear", extrapolate=True)
    clock = clock if clock is not None else SimulatedClock()
    policy = DraftPolicy(nextn, ConfidenceScheduler(nextn, curve), clock=clock if timed else None)
    drafting_per_step = []
    for _ in range(steps):
        plan = policy.plan([(s, nextn) for s in range(num_seqs)], num_seqs)
        ids = [s for s, d in enumerate(plan.draft) if d]
        step_ms = policy.step_ms(num_seqs, num_seqs) + extra_plain_ms
        if ids:
            policy.record_draft_time(len(ids), 0.5)
            conf = [[0.6] * nextn for _ in ids]
            counts = policy.verify_counts(ids, conf, num_seqs)
            for s, k in zip(ids, counts):
                accepted = 0
                while accepted < k and rng.random() < accept_rate:
                    accepted += 1
                policy.record(s, conf[0], k, accepted)
            step_ms = policy.step_ms(num_seqs + sum(counts), num_seqs) + 0.5 + extra_draft_ms
        clock.wait_ms(step_ms)
        drafting_per_step.append(len(ids))
    return drafting_per_step, policy


def test_drafts_that_pay_on_their_parts_but_not_on_the_wall_clock_back_off():
    """Drafts accepted one time in five pay on the parts (a free verification, a 0.5 ms draft forward) but
    not once every drafted step takes 8 ms more: the timed policy backs off to probes, the untimed one
    drafts on."""
    untimed, _ = run(accept_rate=0.2, extra_draft_ms=8.0, timed=False)
    timed, policy = run(accept_rate=0.2, extra_draft_ms=8.0, timed=True)
    assert sum(1 for d in untimed[50:] if d) > 0.9 * len(untimed[50:])
    late = timed[50:]
    assert sum(1 for d in late if d) < 0.15 * len(late), timed
    # a drafted step: 10 ms and the 0.5 ms draft forward predicted, 8 ms more measured
    assert policy.wall_ratio(True) == pytest.approx(18.5 / 10.5)
    assert policy.wall_ratio(False) == pytest.approx(1.0)
    summary = policy.summary()
    assert summary["policy_wall_ratio_draft"] == pytest.approx(18.5 / 10.5)
    assert summary["policy_draft_fraction"] < 0.2


def test_a_curve_that_overstates_every_step_is_corrected_by_timing_both_kinds():
    """The curve says 10 ms where a step takes 2 ms (measured on another path than the engine's steps):
    on the parts, drafts accepted one time in ten pay for their 0.5 ms; on the wall clock they do not.
    Drafted steps alone say only that steps take a fifth of their prediction, which would make drafting
    look cheap; the plain steps timed too say the same of plain steps, and the policy backs off."""
    untimed, _ = run(accept_rate=0.1, extra_draft_ms=-8.0, extra_plain_ms=-8.0, timed=False)
    timed, policy = run(accept_rate=0.1, extra_draft_ms=-8.0, extra_plain_ms=-8.0, timed=True)
    assert sum(1 for d in untimed[50:] if d) > 0.9 * len(untimed[50:])
    assert sum(1 for d in timed[50:] if d) < 0.15 * len(timed[50:]), timed
    assert policy.wall_ratio(True) == pytest.approx(2.5 / 10.5) and policy.wall_ratio(False) == pytest.approx(
        0.2
    )


def test_drafts_that_pay_on_the_wall_clock_keep_drafting():
    """Drafts accepted nine times in ten pay for the 8 ms too: the timed policy drafts on every step but the
    few plain ones it runs to measure them (after its first timed drafted steps)."""
    timed, policy = run(accept_rate=0.9, extra_draft_ms=8.0, timed=True, steps=100)
    assert timed == [8] * 3 + [0] * 3 + [8] * 94
    assert policy.timed_plans == {False: 3, True: 97} and policy.skipped == 3 * 8
    assert policy.wall_ratio(True) == pytest.approx(18.5 / 10.5) and policy.wall_ratio(
        False
    ) == pytest.approx(1.0)


def test_a_clock_that_stands_still_times_nothing():
    """A frozen clock (the engine's tests freeze theirs) measures no step: the plans are the untimed ones."""

    class Frozen(SimulatedClock):
        def wait_ms(self, ms: float) -> None:
            pass

    frozen, policy = run(accept_rate=0.2, extra_draft_ms=8.0, timed=True, clock=Frozen())
    untimed, _ = run(accept_rate=0.2, extra_draft_ms=8.0, timed=False)
    assert frozen == untimed
    assert not policy.wall_ratios[True] and not policy.wall_ratios[False]


def test_a_step_with_prefill_is_not_a_sample():
    curve = StepTimeCurve([1, 64], [10.0, 10.0], mode="linear")
    clock = SimulatedClock()
    policy = DraftPolicy(2, ConfidenceScheduler(2, curve), clock=clock)
    for untimed in (False, True, False):
        policy.plan([(0, 2)], 1)
        clock.wait_ms(500.0 if untimed else 12.0)
        if untimed:
            policy.untimed_step()
    policy.plan([(0, 2)], 1)
    measured = sorted(x for kind in (False, True) for x in policy.wall_ratios[kind])
    assert len(measured) == 2 and all(x < 10.0 for x in measured)  # the 500 ms prefill step left out


def test_the_wall_ratio_is_the_median_of_recent_steps_of_its_kind():
    policy = DraftPolicy(1, ConfidenceScheduler(1, StepTimeCurve([1], [1.0])), clock=SimulatedClock())
    assert policy.wall_ratio(True) == policy.wall_ratio(False) == 1.0
    policy.wall_ratios[True].extend([5.0, 1.0])
    assert policy.wall_ratio(True) == 1.0  # too few
    policy.wall_ratios[True].append(3.0)
    assert policy.wall_ratio(True) == 3.0 and policy.wall_ratio(False) == 1.0
    for x in np.arange(100.0):
        policy.wall_ratios[True].append(float(x))
    assert policy.wall_ratio(True) == float(np.median(np.arange(84.0, 100.0)))  # the last 16
    assert policy.charged_ms(2.0, False) == 2.0 and policy.charged_ms(2.0, True) == 2.0 * 91.5
    policy.wall_ratios[False].extend([200.0] * 3)
    # plain steps caught slower than drafted ones: drafting is charged the plain ratio, never less
    assert policy.charged_ms(2.0, False) == policy.charged_ms(2.0, True) == 400.0


def probe_share(calibrate: bool, steps: int = 400) -> tuple[float, DraftPolicy]:
    """A never-right drafter whose probes are always due (short back-off), so the probe budget alone
    bounds them; the curve says 10 ms where a plain step takes 1.25 ms (an eager-forward curve against
    graphed steps) and a probe's draft forward takes 2 ms. Returns the probes' wall time over the plain
    steps' wall time (every step's 1.25 ms)."""
    curve = StepTimeCurve([1, 64], [10.0, 10.0], mode="linear")
    clock = SimulatedClock()
    nextn, num_seqs = 3, 8
    policy = DraftPolicy(
        nextn, ConfidenceScheduler(nextn, curve), min_backoff=1, max_backoff=2, probe_budget=0.05, clock=clock
    )
    probe_wall = 0.0
    for _ in range(steps):
        plan = policy.plan([(s, nextn) for s in range(num_seqs)], num_seqs)
        ids = [s for s, d in enumerate(plan.draft) if d]
        wall = 1.25
        if ids:
            policy.record_draft_time(len(ids), 2.0)
            conf = [[0.9] * nextn for _ in ids]
            for s, k in zip(ids, policy.verify_counts(ids, conf, num_seqs)):
                policy.record(s, conf[0], k, 0)
            if calibrate:
                policy.calibrate_budget()
            wall += 2.0
            probe_wall += 2.0
        clock.wait_ms(wall)
    return probe_wall / (steps * 1.25), policy


def test_the_probe_budget_is_wall_time_once_calibrated():
    """Calibrated after each drafted step (as the engine does), the probes cost about `probe_budget` of the
    plain steps' wall time, though the curve prices those steps 8x too high; priced on the curve alone the
    same probes take several times the budget."""
    calibrated, policy = probe_share(calibrate=True)
    uncalibrated, _ = probe_share(calibrate=False)
    assert policy.budget_scale == pytest.approx(0.125)
    # (the first steps draft before anything is measured, and a due probe runs once the budget allows it)
    assert calibrated <= 0.05 * 1.6, calibrated
    assert uncalibrated > 4 * calibrated, (uncalibrated, calibrated)
