"""The one exception type of this package.

A structured-output problem belongs to one request: the engine catches this error, fails that
request with the message, and keeps serving the rest of the batch. It subclasses ValueError so
that callers validating user input treat it like any other bad argument.
"""

from __future__ import annotations

import re

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; users need the text after it.
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
# Locations in xgrammar's messages: EBNF "line L, column C", regex "position P".
_LOCATION = re.compile(r"(line \d+, column \d+|position \d+)")


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be served, with what and where.

    Attributes:
        field: the `so_args` key at fault ("schema", "schema_type", "trigger_token_ids", ...).
        location: where inside the schema / regex / grammar (a JSON pointer like "/properties/a",
            "position 4" in a regex, "line 2, column 7" in EBNF), or None.
        reason: the message without the location prefix.
    """

    def __init__(self, field: str, reason: str, location: str | None = None):
        self.field = field
        self.reason = reason
        self.location = location
        where = f" at {location}" if location else ""
        super().__init__(f"so_args[{field!r}]{where}: {reason}")


def from_xgrammar(field: str, what: str, exc: BaseException) -> StructuredOutputError:
    """Wrap an exception raised by xgrammar, keeping its message and the location it names."""
    message = _XGRAMMAR_PREFIX.sub("", str(exc)).strip()
    found = _LOCATION.search(message)
    return StructuredOutputError(
        field, f"xgrammar cannot compile this {what}: {message}", found.group(1) if found else None
    )
