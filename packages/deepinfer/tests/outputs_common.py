"""Comparing two runs' `RequestOutput`s, shared by the tests of engines that must give one engine's outputs
(a distinct module name: several packages have a conftest.py, so tests never import `conftest` by name)."""


def assert_same(got, want):
    """Same requests in the same order, none failed: equal prompts, and per sample equal tokens, logprobs,
    top logprobs, finish reason and text."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.error is None and w.error is None, (g.error, w.error)
        assert g.prompt_token_ids == w.prompt_token_ids
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert a.token_ids == b.token_ids, (g.request_id, a.token_ids, b.token_ids)
            assert a.logprobs == b.logprobs, g.request_id
            assert a.top_logprobs == b.top_logprobs, g.request_id
            assert (a.finish_reason, a.text) == (b.finish_reason, b.text), g.request_id


def assert_same_by_id(got: dict, want: dict):
    """`assert_same` of two {request_id: output} maps holding the same requests."""
    assert sorted(got) == sorted(want)
    assert_same([got[rid] for rid in want], list(want.values()))
