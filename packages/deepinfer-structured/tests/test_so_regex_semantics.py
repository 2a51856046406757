"""The regex semantics the README documents, pinned against xgrammar 0.2.9: whole-string match,
'.' matches a newline, \\d / \\w ASCII, \\s with non-ASCII spaces. Each case is also compared with
Python's re under DOTALL | ASCII, which agrees except for the documented \\s case."""

from __future__ import annotations

import re

import deepinfer_structured as ds
import pytest
from so_common import EOS_ID

CASES = [  # (regex, text, accepted by our constraint)
    (r"a.c", "a\nc", True),
    (r"\w+", "abc_9", True),
    (r"\w", "é", False),
    (r"\d", "٣", False),
    (r"\D", "٣", True),
    (r"\W", "é", True),
    (r"ab", "xaby", False),  # whole-string, not search
    (r"[^a]", "\n", True),
    (r"(ab|cd)+x?", "abcdx", True),
]


@pytest.mark.parametrize(("regex", "text", "accepted"), CASES)
def test_documented_regex_semantics(service, regex, text, accepted):
    state = service.new_state({"schema_type": "regex", "schema": regex})
    got = state.matcher.accept_string(text) and state.accept_token(EOS_ID)
    assert got is accepted
    assert bool(re.fullmatch(regex, text, re.DOTALL | re.ASCII)) is accepted


def test_whitespace_class_includes_non_ascii_spaces(service):
    state = service.new_state({"schema_type": "regex", "schema": r"\s"})
    assert state.matcher.accept_string("\u00a0") and state.accept_token(EOS_ID)
    assert not re.fullmatch(r"\s", "\u00a0", re.ASCII)  # the documented difference from re.ASCII
    assert isinstance(ds.parse_so_args({"schema_type": "regex", "schema": r"\s"}), ds.StructuredOutputRequest)
