"""Comparing two runs' `RequestOutput`s, shared by the tests of engines that must give one engine's outputs
(a distinct module name: several packages have a conftest.py, so tests never import `conftest` by name)."""

import dataclasses
import math
import os

# On the CPU a row's logits do not depend on the batch it ran in; on CUDA (DEEPINFER_DEVICE=cuda, not
# batch-invariant mode) GEMMs of another row count round differently, so engines that batch a request's
# steps differently (a prefill engine, a rank) agree on tokens and on logprobs to rounding only.
LOGPROB_RTOL = (
    1e-5
    if os.environ.get("DEEPINFER_DEVICE", "cpu").startswith("cuda")
    and os.environ.get("DEEPINFER_BATCH_INVARIANT", "0") in ("", "0")
    else 0.0
)


def same_values(a, b) -> bool:
    """Equal structure and keys, numbers equal within LOGPROB_RTOL (exactly where it is 0)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_values, a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):  # a Logprob
        return type(a) is type(b) and same_values(dataclasses.astuple(a), dataclasses.astuple(b))
    if isinstance(a, float) and isinstance(b, float) and LOGPROB_RTOL:
        return math.isclose(a, b, rel_tol=LOGPROB_RTOL, abs_tol=LOGPROB_RTOL)
    return a == b


def assert_same(got, want):
    """Same requests in the same order, none failed: equal prompts, and per sample equal tokens, logprobs,
    top logprobs (to rounding on CUDA: LOGPROB_RTOL), finish reason and text."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.error is None and w.error is None, (g.error, w.error)
        assert g.prompt_token_ids == w.prompt_token_ids
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert a.token_ids == b.token_ids, (g.request_id, a.token_ids, b.token_ids)
            assert same_values(a.logprobs, b.logprobs), (g.request_id, a.logprobs, b.logprobs)
            assert same_values(a.top_logprobs, b.top_logprobs), (g.request_id, a.top_logprobs, b.top_logprobs)
            assert (a.finish_reason, a.text) == (b.finish_reason, b.text), g.request_id


def assert_same_by_id(got: dict, want: dict):
    """`assert_same` of two {request_id: output} maps holding the same requests."""
    assert sorted(got) == sorted(want)
    assert_same([got[rid] for rid in want], list(want.values()))
