"""Refuse regex features that xgrammar 0.2.9 would ignore or misread.

xgrammar errors out on most unsupported syntax, but some it accepts with only a log line and then
matches something else: a lookahead inside a JSON-schema `pattern` is dropped, `^` / `$` in the
middle are dropped, unknown escapes like `\\A` or `\\Z` match the letter itself. Any of those would
let the model produce text the user's regex rejects, so we refuse them up front, naming the
position. Everything else is checked by Python's `re` (our documented semantics) and by xgrammar.
"""

from __future__ import annotations

import re

from .errors import StructuredOutputError

# Escapes whose meaning xgrammar and Python's `re` share.
_CLASS_ESCAPES = set("dDwWsS")
_CHAR_ESCAPES = set("nrtfv0")
_HEX_DIGITS = set("0123456789abcdefABCDEF")

_GROUP_MODIFIERS = {
    "(?=": "lookahead",
    "(?!": "negative lookahead",
    "(?<=": "lookbehind",
    "(?<!": "negative lookbehind",
    "(?P<": "named group",
    "(?P=": "named backreference",
    "(?>": "atomic group",
    "(?#": "comment group",
}


def audit_regex(pattern: str, field: str = "schema", where: str = "") -> None:
    """Raise StructuredOutputError unless `pattern` uses only syntax xgrammar enforces exactly.

    `where` prefixes the location (e.g. the JSON pointer of a schema `pattern`).
    """

    def fail(pos: int, what: str) -> None:
        raise StructuredOutputError(
            field, f"unsupported regex feature: {what} in {pattern!r}", f"{where}position {pos}"
        )

    try:
        re.compile(pattern)
    except re.error as exc:
        raise StructuredOutputError(
            field, f"invalid regex {pattern!r}: {exc.msg}", f"{where}position {exc.pos}"
        ) from None

    in_class = False
    i = 0
    n = len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            if i + 1 >= n:
                fail(i, "trailing backslash")
            nxt = pattern[i + 1]
            if nxt.isdigit() and nxt != "0":
                fail(i, f"backreference \\{nxt}")
            if nxt == "x":
                digits = pattern[i + 2 : i + 4]
                if len(digits) != 2 or not set(digits) <= _HEX_DIGITS:
                    fail(i, "\\x needs two hex digits")
                i += 4
                continue
            if nxt == "u":
                digits = pattern[i + 2 : i + 6]
                if len(digits) != 4 or not set(digits) <= _HEX_DIGITS:
                    fail(i, "\\u needs four hex digits")
                i += 6
                continue
            if nxt.isalnum() and nxt not in _CLASS_ESCAPES and nxt not in _CHAR_ESCAPES:
                fail(i, f"escape \\{nxt} (anchors, word boundaries, unicode classes are not supported)")
            i += 2
            continue
        if in_class:
            if ch == "]":
                in_class = False
            i += 1
            continue
        if ch == "[":
            in_class = True
            # A ']' right after '[' or '[^' is a literal, not the end of the class.
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            continue
        if ch == "(" and pattern.startswith("(?", i):
            if pattern.startswith("(?:", i):
                i += 3
                continue
            for prefix, name in _GROUP_MODIFIERS.items():
                if pattern.startswith(prefix, i):
                    fail(i, name)
            fail(i, "inline flags or group modifier")
        if ch == "^" and i != 0:
            fail(i, "'^' anchor that is not at the start")
        if ch == "$" and i != n - 1:
            fail(i, "'$' anchor that is not at the end")
        i += 1
