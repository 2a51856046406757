"""StructuredOutputManager: the engine-facing lifecycle, with one-request-only failures."""

from __future__ import annotations

import json
import time

import deepinfer_structured as ds
import pytest
import torch
from so_common import EOS_ID, VOCAB_SIZE


@pytest.fixture()
def manager(tokenizer_info):
    mgr = ds.StructuredOutputManager(tokenizer_info, compile_threads=2, timeout_s=60.0)
    yield mgr
    mgr.compiler.shutdown()


def wait_ready(mgr, ids):
    failures = {}
    deadline = time.monotonic() + 60
    while mgr.num_pending and time.monotonic() < deadline:
        failures.update(mgr.poll())
        time.sleep(0.01)
    assert all(mgr.is_ready(i) or i in failures for i in ids)
    return failures


def test_lifecycle_and_per_request_failures(manager, tokenizer):
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    with pytest.raises(ds.StructuredOutputError, match="lookahead"):
        manager.add_request("bad-regex", {"schema_type": "regex", "schema": "a(?=b)"})
    manager.add_request("num", {"schema_type": "regex", "schema": "[0-9]{2}"})
    manager.add_request("bad-ebnf", {"schema_type": "ebnf", "schema": "root ::= nope"})
    manager.add_request(
        "obj",
        {
            "schema_type": "json",
            "schema": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]},
            "any_whitespace": False,
        },
    )
    with pytest.raises(ValueError, match="already registered"):
        manager.add_request("num", {"schema_type": "json_object"})
    failures = wait_ready(manager, ["num", "bad-ebnf", "obj"])
    assert set(failures) == {"bad-ebnf"} and "line 1, column 10" in str(failures["bad-ebnf"])
    assert manager.is_ready("num") and manager.is_ready("obj") and not manager.is_ready("bad-ebnf")

    # One step: a free row 0, "num" on row 1, "obj" on rows 2..3 with one draft.
    first = enc('{"k"')
    masks, failed = manager.fill([("num", 1, []), ("obj", 2, first[:1])], num_rows=4)
    assert not failed and masks.rows == [1, 2, 3] and masks.valid_drafts == [0, 1]
    logits = torch.zeros(4, VOCAB_SIZE)
    manager.apply(logits, masks)
    assert torch.isfinite(logits[0]).all()
    allowed_num = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed_num and all(tokenizer.decode([t]).isdigit() for t in allowed_num)

    assert manager.accept("obj", first) is None
    err = manager.accept("num", enc("x"))
    assert isinstance(err, ds.StructuredOutputError) and not manager.is_ready("num")  # dropped
    assert manager.accept("obj", enc(": true}") + [EOS_ID]) is None
    assert manager.is_terminated("obj")
    text = tokenizer.decode(first + enc(": true}"))
    assert json.loads(text) == {"k": True}

    # Preemption: rebuild from the emitted tokens, then a bad history fails only that request.
    assert manager.rebuild("obj", first) is None and not manager.is_terminated("obj")
    assert isinstance(manager.rebuild("obj", enc("[1]")), ds.StructuredOutputError)
    assert not manager.is_ready("obj")


class _BrokenMatcher:
    """Stands in for an xgrammar matcher that raises (xgrammar's C++ can throw at fill time)."""

    def is_terminated(self):
        return False

    def fill_next_token_bitmask(self, bitmask, row):
        raise RuntimeError("simulated xgrammar failure")


def test_a_matcher_that_raises_fails_only_its_request(manager, tokenizer):
    manager.add_request("a", {"schema_type": "regex", "schema": "[a-c]+"})
    manager.add_request("b", {"schema_type": "regex", "schema": "[x-z]+"})
    wait_ready(manager, ["a", "b"])
    manager.state("a").matcher = _BrokenMatcher()
    masks, failed = manager.fill([("a", 0, []), ("b", 1, [])], num_rows=2)
    assert set(failed) == {"a"} and "simulated" in str(failed["a"])
    assert masks.rows == [1] and not manager.is_ready("a")
    allowed = ds.unpack_bitmask(masks.bitmask[1:2], VOCAB_SIZE)[0].nonzero().flatten().tolist()
    assert allowed and all(set(tokenizer.decode([t])) <= set("xyz") for t in allowed)
