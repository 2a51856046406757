"""The MTP-varlen rule against brute force over every per-request allocation of verified drafts."""

import itertools
import random

import pytest
from deepinfer_spec import (
    ConfidenceScheduler,
    ForwardRuntimeEstimator,
    SamplerRuntimeEstimator,
    StepTimeCurve,
    VarlenRequest,
    cumulative_rates,
    split_by_rates,
)


def random_case(rng: random.Random):
    num_seqs = rng.randint(1, 4)
    nextn = rng.randint(1, 4)
    rates = [cumulative_rates([rng.random() ** 0.5 for _ in range(nextn)]) for _ in range(num_seqs)]
    max_tokens = num_seqs * (1 + nextn)
    sizes = sorted(rng.sample(range(1, max_tokens + 3), rng.randint(1, min(6, max_tokens + 2))))
    if sizes[-1] < num_seqs:
        sizes.append(max_tokens)
    ms, t = [], rng.uniform(0.5, 2.0)
    for _ in sizes:  # increasing step times with random (also convex / concave) increments
        t += rng.uniform(0.0, 1.5)
        ms.append(t)
    return nextn, rates, sizes, ms


def brute_force_best(rates, curve, slope=0.0, sampler_ms=0.0):
    """Max over every allocation k_i <= nd_i (each a prefix) of expected tokens / step time."""
    num_seqs, best = len(rates), -1.0
    for ks in itertools.product(*[range(len(r) + 1) for r in rates]):
        charged = curve.charged(num_seqs + sum(ks))
        if charged is None:
            continue
        size, baseline = charged
        expected = num_seqs + sum(sum(r[:k]) for r, k in zip(rates, ks))
        best = max(best, expected / (baseline + slope * size + sampler_ms))
    return best


@pytest.mark.parametrize("mode", ["bucket", "linear"])
def test_varlen_picks_the_throughput_optimal_total(mode):
    rng = random.Random(1234 if mode == "bucket" else 99)
    for _ in range(150):
        nextn, rates, sizes, ms = random_case(rng)
        curve = StepTimeCurve(sizes, ms, mode)
        scheduler = ConfidenceScheduler(nextn, curve)
        requests = [VarlenRequest(nextn, r, r, has_draft_info=True) for r in rates]
        plan = scheduler.choose(requests)
        best = brute_force_best(rates, curve)
        charged = curve.charged(plan.num_tokens)
        if charged is None:  # not even one token per request fits: nothing is verified
            assert best < 0 and plan.num_verify == [0] * len(rates)
            continue
        got = (len(rates) + sum(sum(r[:k]) for r, k in zip(rates, plan.num_verify))) / charged[1]
        assert got == pytest.approx(best, rel=1e-12)
        assert plan.expected_tokens / plan.predicted_ms == pytest.approx(best, rel=1e-12)


def test_runtime_estimates_enter_the_step_time():
    rng = random.Random(5)
    for _ in range(50):
        nextn, rates, sizes, ms = random_case(rng)
        curve = StepTimeCurve(sizes, ms)
        scheduler = ConfidenceScheduler(nextn, curve)
        slope, sampler_ms = rng.uniform(0, 0.5), rng.uniform(0, 2)
        for _ in range(10):
            scheduler.update_runtime(sizes[-1], ms[-1] + slope * sizes[-1], len(rates), sampler_ms)
        assert scheduler.forward_estimator.get() == pytest.approx(slope)
        plan = scheduler.choose([VarlenRequest(nextn, r, r, has_draft_info=True) for r in rates])
        if plan.predicted_ms is None:
            continue
        assert plan.expected_tokens / plan.predicted_ms == pytest.approx(
            brute_force_best(rates, curve, slope, sampler_ms), rel=1e-9
        )


def test_each_request_gets_a_prefix_holding_the_top_ranked_positions():
    rng = random.Random(7)
    for _ in range(100):
        rates = [
            cumulative_rates([rng.random() for _ in range(rng.randint(0, 5))])
            for _ in range(rng.randint(1, 5))
        ]
        flat = sorted((r for req in rates for r in req), reverse=True)
        total = rng.randint(0, len(flat))
        counts = split_by_rates(total, rates)
        assert sum(counts) == total and all(0 <= k <= len(r) for k, r in zip(counts, rates))
        assert sum(sum(r[:k]) for r, k in zip(rates, counts)) == pytest.approx(sum(flat[:total]))


def test_split_ties_go_to_the_lower_request_index():
    assert split_by_rates(3, [[0.5, 0.5], [0.5, 0.5]]) == [2, 1]
    assert split_by_rates(1, [[0.2], [0.9, 0.1]]) == [0, 1]


def test_varlen_off_verifies_every_draft():
    scheduler = ConfidenceScheduler(nextn=5)
    assert not scheduler.enabled
    plan = scheduler.choose(
        [VarlenRequest(5, cumulative_rates([0.1] * 5)), VarlenRequest(0), VarlenRequest(5)]
    )
    assert plan.num_verify == [5, 0, 5] and plan.seqlens_q == [6, 1, 6] and plan.predicted_ms is None


def test_budget_uses_previous_round_rates_when_the_last_step_is_processed():
    flat = StepTimeCurve([10], [1.0])  # every size up to 10 costs the same: take every positive rate
    scheduler = ConfidenceScheduler(3, flat)
    current, previous = [0.9, 0.5, 0.2], [0.3, 0.1, 0.0]
    paired = scheduler.choose([VarlenRequest(3, current, previous, schedule_cnt=4, process_cnt=4)])
    assert paired.expected_tokens == pytest.approx(1 + 0.3 + 0.1)  # budget: round N-2 (strict gain only)
    assert paired.num_verify == [2]  # split with the current rates: a prefix of 2
    unpaired = scheduler.choose([VarlenRequest(3, current, previous, schedule_cnt=5, process_cnt=4)])
    assert unpaired.expected_tokens == pytest.approx(1 + 0.9 + 0.5 + 0.2)
    assert unpaired.num_verify == [3]


def test_missing_rates_are_padded_optimistically_only_with_draft_info():
    flat = StepTimeCurve([10], [1.0])
    scheduler = ConfidenceScheduler(2, flat)
    assert scheduler.choose([VarlenRequest(2, has_draft_info=True)]).num_verify == [2]
    assert scheduler.choose([VarlenRequest(2, has_draft_info=False)]).num_verify == [0]
    # Not yet processed (asynchronous scheduling): it will have drafts by then.
    assert scheduler.choose([VarlenRequest(2, schedule_cnt=1, process_cnt=0)]).num_verify == [2]


def test_curve_charging_bucket_and_linear():
    bucket = StepTimeCurve([4, 8, 16], [1.0, 2.0, 6.0])
    assert bucket.charged(1) == (4, 1.0) and bucket.charged(5) == (8, 2.0) and bucket.charged(16) == (16, 6.0)
    assert bucket.charged(17) is None
    linear = StepTimeCurve([4, 8, 16], [1.0, 2.0, 6.0], mode="linear")
    assert linear.charged(2) == (2, 1.0) and linear.charged(6) == (6, 1.5) and linear.charged(12) == (12, 4.0)


def test_curve_file_round_trip_and_measure(tmp_path):
    curve = StepTimeCurve([2, 4], [1.5, 2.5], mode="linear")
    curve.save(tmp_path / "curve.json")
    loaded = StepTimeCurve.load(tmp_path / "curve.json")
    assert loaded.to_dict() == curve.to_dict()
    ticks = iter(range(1000))  # a fake clock: one second per reading
    measured = StepTimeCurve.measure(lambda n: None, [1, 3], repeats=3, clock=lambda: float(next(ticks)))
    assert measured.sizes == [1, 3] and measured.forward_ms == pytest.approx([1000.0, 1000.0])


def test_forward_estimator_median_of_per_size_medians():
    est = ForwardRuntimeEstimator(window=100, min_samples=3)
    for v in [1.0, 2.0, 9.0]:
        est.add(8, v)  # median 2
    for v in [4.0, 5.0, 6.0, 100.0]:
        est.add(16, v)  # median 5.5
    est.add(32, 50.0)  # too few samples: ignored
    assert est.get() == pytest.approx((2.0 + 5.5) / 2)
    small = ForwardRuntimeEstimator(window=3, min_samples=3)
    for v in [1.0, 1.0, 1.0, 7.0, 8.0, 9.0]:
        small.add(4, v)  # only the last three stay in the window
    assert small.get() == 8.0


def test_sampler_estimator_per_size_then_global_then_zero():
    est = SamplerRuntimeEstimator(window=9, min_samples=5)
    assert est.get(4) == 0.0
    for v in [1, 2, 3, 4]:
        est.add(4, v)
    assert est.get(4) == 0.0  # 4 samples: not enough anywhere
    est.add(8, 10.0)
    assert est.get(4) == 3.0  # global median of [1, 2, 3, 4, 10]
    est.add(4, 5)
    assert est.get(4) == 3.0  # own median of [1..5]
    for v in range(20):
        est.add(4, 100 + v)
    assert est.get(4) == 115.0  # window of the last 9: 111..119


def test_the_device_split_equals_the_host_split():
    """`split_by_rates_tensor` (the ZOS re-split on the device) against `split_by_rates` on random
    rates with ties, requests with fewer drafts than nextn, and totals as ints and as tensors."""
    import torch
    from deepinfer_spec import split_by_rates_tensor

    rng = random.Random(3)
    for _ in range(300):
        num_seqs, nextn = rng.randint(1, 6), rng.randint(1, 5)
        levels = [0.0, 0.25, 0.5, 1.0] if rng.random() < 0.5 else None  # many ties
        nds = [rng.randint(0, nextn) for _ in range(num_seqs)]
        rates = [
            cumulative_rates([rng.choice(levels) if levels else rng.random() for _ in range(nd)])
            for nd in nds
        ]
        total = rng.randint(0, sum(nds))
        want = split_by_rates(total, rates)
        padded = torch.tensor([r + [0.5] * (nextn - len(r)) for r in rates], dtype=torch.float64)
        nd = torch.tensor(nds)
        for t in (total, torch.tensor(total)):
            assert split_by_rates_tensor(t, padded, nd).tolist() == want
    ties = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    assert split_by_rates_tensor(3, ties, torch.tensor([2, 2])).tolist() == [2, 1]
    assert split_by_rates_tensor(9, ties, torch.tensor([2, 1])).tolist() == [2, 1]
