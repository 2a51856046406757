"""Pareto-front extraction against a sort-and-sweep reference."""

from deepinfer.bench import pareto_front
from hypothesis import given
from hypothesis import strategies as st


def _sweep_front(xs, ys, x_higher_is_better):
    """Reference: walk from the best x to the worst; a point is on the front when its y beats every
    y seen so far (ties in x are resolved by taking the highest y of the tie group first)."""
    sign = 1 if x_higher_is_better else -1
    order = sorted(range(len(xs)), key=lambda i: (-sign * xs[i], -ys[i]))
    front, best_y, prev = [], float("-inf"), None
    for i in order:
        if ys[i] > best_y:
            front.append(i)
            best_y = ys[i]
        elif prev is not None and xs[i] == xs[prev] and ys[i] == ys[prev] and prev in front:
            front.append(i)  # an exact duplicate of a front point is not dominated either
        prev = i
    return sorted(front, key=lambda i: xs[i])


def test_decode_front_by_hand():
    # (tok/s/user, tok/s/GPU): batch 8 (fast users), 16, 32 (dominated by 64), 64, 128
    xs = [100.0, 80.0, 40.0, 45.0, 20.0]
    ys = [800.0, 1280.0, 1200.0, 2880.0, 2560.0]
    assert pareto_front(xs, ys, x_higher_is_better=True) == [3, 1, 0]


def test_prefill_front_by_hand():
    # (latency ms, tok/s/GPU): lower latency is better
    xs = [10.0, 20.0, 25.0, 40.0]
    ys = [400.0, 800.0, 700.0, 1600.0]
    assert pareto_front(xs, ys, x_higher_is_better=False) == [0, 1, 3]


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=12),
    st.booleans(),
)
def test_front_matches_the_sweep_reference(points, higher):
    xs = [float(p[0]) for p in points]
    ys = [float(p[1]) for p in points]
    assert sorted(pareto_front(xs, ys, higher)) == sorted(_sweep_front(xs, ys, higher))
