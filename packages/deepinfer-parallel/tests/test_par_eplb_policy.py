"""The EPLB planner: spec phases against naive re-implementations, and plan properties on traces."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_parallel.eplb import greedy_rebalance, peak_sum, place, rank_loads, rebalance, replicate
from deepinfer_parallel.layout import initial_phys_to_logical


def naive_replicate(tokens, num_physical):
    """Phase 1 by brute force: try every expert, keep the cheapest (lowest id on ties)."""
    w, num_layers, num_logical = tokens.shape
    out = []
    for layer in range(num_layers):
        count = [1] * num_logical
        extra = []
        for _ in range(num_physical - num_logical):
            cur = [
                [(tokens[t, layer, e] + 1e-4 * e) / count[e] for e in range(num_logical)] for t in range(w)
            ]
            costs = []
            for e in range(num_logical):
                total = 0.0
                for t in range(w):
                    row = list(cur[t])
                    row[e] = tokens[t, layer, e] / (count[e] + 1)
                    total += max(row)
                costs.append(total)
            best = min(range(num_logical), key=lambda e: (costs[e], e))
            count[best] += 1
            extra.append(best)
        out.append(list(range(num_logical)) + extra)
    return out


def naive_place(tokens, slots, num_ranks):
    """Phase 2 by plain loops over slots, ranks and steps."""
    w, num_layers, num_logical = tokens.shape
    num_physical = len(slots[0])
    per_rank = num_physical // num_ranks
    out = []
    for layer in range(num_layers):
        s = slots[layer]
        count = {e: s.count(e) for e in set(s)}
        v = [[tokens[t, layer, e] / count[e] for t in range(w)] for e in s]
        order = sorted(range(num_physical), key=lambda p: -sum(v[p]))  # sorted() is stable
        load = [[0.0] * w for _ in range(num_ranks)]
        peak = [0.0] * w
        placed = [[] for _ in range(num_ranks)]
        for p in order:
            scores = [
                sum(max(peak[t], load[r][t] + v[p][t]) for t in range(w))
                if len(placed[r]) < per_rank
                else float("inf")
                for r in range(num_ranks)
            ]
            r = min(range(num_ranks), key=lambda i: (scores[i], i))
            load[r] = [a + b for a, b in zip(load[r], v[p])]
            peak = [max(a, b) for a, b in zip(peak, load[r])]
            placed[r].append(s[p])
        out.append([e for r in placed for e in r])
    return out


def zipf_trace(seed, steps=6, layers=3, experts=12, tokens=200, a=1.2):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, experts + 1) ** a
    out = np.zeros((steps, layers, experts))
    for layer in range(layers):
        perm = rng.permutation(experts)
        out[:, layer, perm] = rng.multinomial(tokens, p / p.sum(), size=steps)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replicate_matches_brute_force(seed):
    tokens = torch.tensor(zipf_trace(seed))
    tokens[:, 0, 3] = 0  # an idle expert
    assert replicate(tokens, 20).tolist() == naive_replicate(tokens.numpy(), 20)


@pytest.mark.parametrize(("seed", "ranks"), [(0, 4), (1, 5), (2, 2)])
def test_place_matches_naive_loops(seed, ranks):
    tokens = torch.tensor(zipf_trace(seed))
    slots = replicate(tokens, 20)
    got = place(tokens, slots, ranks).tolist()
    assert got == naive_place(tokens.numpy(), slots.tolist(), ranks)


def check_plan(plan, num_logical, num_physical, num_ranks):
    p2l = plan.phys_to_logical
    assert p2l.shape[1] == num_physical
    for layer in range(p2l.shape[0]):
        counts = np.bincount(p2l[layer], minlength=num_logical)
        assert counts.min() >= 1, "every expert keeps at least one replica"
        assert (counts == plan.replica_count[layer]).all()
        for e in range(num_logical):
            slots = plan.logical_to_physical[layer, e]
            real = slots[slots >= 0]
            assert len(real) == counts[e] and (p2l[layer, real] == e).all()
    # Capacity: exactly num_physical / num_ranks slots per rank, by construction of the [R, S] reshape.
    assert p2l.reshape(p2l.shape[0], num_ranks, -1).shape[2] == num_physical // num_ranks


@pytest.mark.parametrize("kind", ["uniform", "zipf", "hot", "sparse"])
@pytest.mark.parametrize(("num_physical", "num_ranks"), [(16, 4), (24, 8), (20, 5), (16, 16)])
def test_plan_properties(kind, num_physical, num_ranks):
    rng = np.random.default_rng(hash((kind, num_physical)) % 2**32)
    experts, layers, steps = 12, 4, 8
    if kind == "uniform":
        trace = rng.poisson(20, (steps, layers, experts)).astype(float)
    elif kind == "zipf":
        trace = zipf_trace(3, steps, layers, experts, a=1.5)
    elif kind == "hot":
        trace = rng.poisson(5, (steps, layers, experts)).astype(float)
        trace[:, :, [2, 7]] += 200
    else:
        trace = np.zeros((steps, layers, experts))
        trace[rng.integers(0, steps, 10), rng.integers(0, layers, 10), rng.integers(0, experts, 10)] = 50
    plan = rebalance(trace, num_physical, num_ranks)
    check_plan(plan, experts, num_physical, num_ranks)
    initial = initial_phys_to_logical(experts, num_physical)
    before = peak_sum(trace, np.broadcast_to(initial, (layers, num_physical)), num_ranks)
    after = peak_sum(trace, plan.phys_to_logical, num_ranks)
    assert (after <= before + 1e-9).all(), "never worse than the initial placement on the same trace"
    check_plan(greedy_rebalance(trace, num_physical, num_ranks), experts, num_physical, num_ranks)


def test_plan_improves_a_skewed_trace():
    trace = zipf_trace(5, steps=16, layers=2, experts=16, tokens=2000, a=1.2)
    plan = rebalance(trace, 24, 4)
    loads = rank_loads(trace, plan.phys_to_logical, 4)
    init = rank_loads(trace, initial_phys_to_logical(16, 24), 4)
    ratio = lambda x: float(x.amax(-1).sum() / x.mean(-1).sum())  # noqa: E731
    assert ratio(loads) < 0.8 * ratio(init)
    # Rank loads account for every token exactly once.
    assert torch.allclose(loads.sum(-1), torch.tensor(trace).sum(-1))


def test_current_placement_is_kept_when_better():
    trace = zipf_trace(6, layers=2)
    first = rebalance(trace, 16, 4)
    again = rebalance(trace, 16, 4, current=first.phys_to_logical)
    assert (
        peak_sum(trace, again.phys_to_logical, 4) <= peak_sum(trace, first.phys_to_logical, 4) + 1e-9
    ).all()


def test_bad_planner_arguments():
    trace = np.ones((2, 1, 8))
    with pytest.raises(ValueError, match="num_replicas=6 must be >= number of experts 8"):
        rebalance(trace, 6, 2)
    with pytest.raises(ValueError, match="num_replicas=10 must be divisible by num_ranks=4"):
        rebalance(trace, 10, 4)
    with pytest.raises(ValueError, match="tokens must be \\[window, layers, experts\\]"):
        rebalance(np.ones(8), 8, 2)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        rebalance(-trace, 8, 2)
