"""The FP64 weight cache must never serve a stale copy: linear() results track in-place updates."""

import torch
from deepinfer_model.numerics import linear, weight_fp64


def test_cached_copy_is_reused_until_the_weight_changes_in_place():
    w = torch.randn(8, 4)
    first = weight_fp64(w)
    assert first.dtype == torch.float64 and torch.equal(first, w.double())
    assert weight_fp64(w) is first  # no new conversion per call

    w.mul_(2.0)  # e.g. an EPLB weight shuffle writes expert weights in place
    second = weight_fp64(w)
    assert second is not first and torch.equal(second, w.double())


def test_linear_follows_in_place_updates_and_distinct_tensors():
    x = torch.randn(3, 4)
    w = torch.randn(5, 4)
    before = linear(x, w)
    torch.testing.assert_close(before, (x.double() @ w.double().t()).float().double(), rtol=0, atol=0)
    w.copy_(torch.randn(5, 4))
    after = linear(x, w)
    torch.testing.assert_close(after, (x.double() @ w.double().t()).float().double(), rtol=0, atol=0)
    # A different tensor that may reuse a freed id gets its own copy.
    del w
    w2 = torch.randn(5, 4)
    torch.testing.assert_close(linear(x, w2), (x.double() @ w2.double().t()).float().double(), rtol=0, atol=0)
