"""Parse and validate `SamplingParams.so_args` into a StructuredOutputRequest.

Accepted spellings (ours and the reference's, see README):

    schema_type   ours: "json_schema", "json_object", "regex", "ebnf"
                  reference: "json" (= "json_schema"); "grammar" is taken as "ebnf"
    schema        JSON schema as a dict/bool or JSON text; a regex string; an EBNF string;
                  absent (or None) for "json_object"
    trigger_token_ids   reference: grammar engages only after this token sequence is emitted
    bound_token_id      reference: once emitted, the rest of the trigger is forced
    any_whitespace      ours (JSON only, default True): allow any JSON whitespace
    max_whitespace      ours (JSON only, default None): at most this many whitespace chars in a row

Refused keys: "serialized" (precompiled grammars) and "bound_token_ids" (the reference's old key).
All of the checking that needs no tokenizer happens here, so a bad request fails when it is added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import StructuredOutputError
from .regex_audit import audit_regex
from .schema_audit import audit_json_schema

SCHEMA_TYPES = ("json_schema", "json_object", "regex", "ebnf")
_ALIASES = {"json": "json_schema", "grammar": "ebnf"}
_KNOWN_KEYS = {
    "schema_type",
    "schema",
    "trigger_token_ids",
    "bound_token_id",
    "any_whitespace",
    "max_whitespace",
}
_REFUSED_KEYS = {
    "serialized": "precompiled (serialized) grammars are not accepted; send the schema text",
    "bound_token_ids": "the old list form is not accepted; use 'bound_token_id' (one int)",
}


@dataclass(frozen=True)
class StructuredOutputRequest:
    """A validated structured-output request.

    `schema_text` is canonical: JSON is re-serialised compactly with key order kept (xgrammar emits
    properties in declared order), so schemas that differ only in whitespace share a compile.
    """

    schema_type: str
    schema_text: str
    trigger_token_ids: tuple[int, ...] = ()
    bound_token_id: int | None = None
    any_whitespace: bool = True
    max_whitespace: int | None = None

    @property
    def cache_key(self) -> tuple:
        """What the compiled grammar depends on (triggers are handled outside the grammar)."""
        if self.schema_type in ("json_schema", "json_object"):
            return (self.schema_type, self.schema_text, self.any_whitespace, self.max_whitespace)
        return (self.schema_type, self.schema_text)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_so_args(so_args: Any) -> StructuredOutputRequest:
    """Validate a user's `so_args` dict; raise StructuredOutputError (a ValueError) if it is bad."""
    if isinstance(so_args, StructuredOutputRequest):
        return so_args
    if not isinstance(so_args, dict):
        raise StructuredOutputError("so_args", f"must be a dict, got {type(so_args).__name__}")
    for key in so_args:
        if key in _REFUSED_KEYS:
            raise StructuredOutputError(key, _REFUSED_KEYS[key])
        if key not in _KNOWN_KEYS:
            raise StructuredOutputError(key, f"unknown key; allowed keys: {sorted(_KNOWN_KEYS)}")

    raw_type = so_args.get("schema_type")
    schema_type = _ALIASES.get(raw_type, raw_type)
    if schema_type not in SCHEMA_TYPES:
        raise StructuredOutputError(
            "schema_type",
            f"must be one of {list(SCHEMA_TYPES)} (or the reference's 'json'), got {raw_type!r}",
        )

    triggers = so_args.get("trigger_token_ids") or ()
    if not isinstance(triggers, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in triggers):
        raise StructuredOutputError("trigger_token_ids", "must be a list of non-negative ints")
    bound = so_args.get("bound_token_id")
    if bound is not None:
        if not _is_int(bound) or bound < 0:
            raise StructuredOutputError("bound_token_id", f"must be a non-negative int, got {bound!r}")
        if not triggers:
            raise StructuredOutputError("bound_token_id", "requires a non-empty 'trigger_token_ids'")

    any_ws = so_args.get("any_whitespace", True)
    max_ws = so_args.get("max_whitespace")
    if not isinstance(any_ws, bool):
        raise StructuredOutputError("any_whitespace", f"must be a bool, got {any_ws!r}")
    if max_ws is not None and (not _is_int(max_ws) or max_ws < 1):
        raise StructuredOutputError("max_whitespace", f"must be an int >= 1 or None, got {max_ws!r}")
    if schema_type not in ("json_schema", "json_object") and (
        "any_whitespace" in so_args or max_ws is not None
    ):
        raise StructuredOutputError("any_whitespace", "whitespace options apply only to JSON schema types")

    text = _canonical_schema(schema_type, so_args.get("schema"))
    return StructuredOutputRequest(schema_type, text, tuple(triggers), bound, any_ws, max_ws)


def _canonical_schema(schema_type: str, schema: Any) -> str:
    if schema_type == "json_object":
        if schema not in (None, "", {}):
            raise StructuredOutputError("schema", "must be absent for 'json_object' (use 'json_schema')")
        return ""
    if schema_type == "json_schema":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(
                    "schema", f"is not valid JSON: {exc.msg}", f"line {exc.lineno}, column {exc.colno}"
                ) from None
        elif not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("schema", "must be a JSON schema (dict, bool or JSON text)")
        return json.dumps(audit_json_schema(schema), separators=(",", ":"), ensure_ascii=False)
    if not isinstance(schema, str) or not schema:
        raise StructuredOutputError("schema", f"must be a non-empty string for {schema_type!r}")
    if schema_type == "regex":
        audit_regex(schema)
    return schema
