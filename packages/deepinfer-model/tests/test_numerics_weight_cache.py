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


def test_inference_tensors_are_converted_marked_and_stacked_without_a_version_counter():
    # Under torch.inference_mode (the public V4 forward, or a caller's own block) tensors keep no version
    # counter and reading it raises: the caches guarded by it must convert afresh instead of failing, and
    # still follow a change in place.
    from deepinfer_model import batch_invariant

    with torch.inference_mode():
        w = torch.randn(64, 32)
        x = torch.randn(3, 32)
        assert batch_invariant.version_of(w) is None
        assert torch.equal(weight_fp64(w), w.double())
        w.mul_(2.0)
        assert torch.equal(weight_fp64(w), w.double())  # never a stale copy
        marked = batch_invariant.mark_fp32_valued(x)
        assert marked is x and not batch_invariant.marked_fp32_valued(x)  # no mark without a version
        experts = torch.randn(2, 64, 32).float()
        parts = batch_invariant.stacked_parts(experts)
        assert parts is not None and torch.equal(parts[:, :, :64], experts.transpose(1, 2).double())
        experts.add_(1.0)
        again = batch_invariant.stacked_parts(experts)
        assert torch.equal(again[:, :, :64], experts.transpose(1, 2).double())
    y = torch.randn(2, 4)
    assert batch_invariant.version_of(y) == y._version
    batch_invariant.mark_fp32_valued(y)
    assert batch_invariant.marked_fp32_valued(y)
    y.add_(1.0)
    assert not batch_invariant.marked_fp32_valued(y)  # a change in place voids the mark
