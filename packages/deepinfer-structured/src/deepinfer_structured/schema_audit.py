"""Refuse JSON-schema keywords that xgrammar 0.2.9 accepts but does not enforce.

We checked by experiment (tests/test_so_schema_audit.py keeps the evidence) which keywords
xgrammar really enforces. A schema may only use those, plus pure annotations. A keyword from the
JSON Schema vocabulary that xgrammar would silently drop is refused with its JSON pointer, because
the model could then produce output that fails the user's schema. Keywords outside the JSON Schema
vocabulary (e.g. OpenAPI's "nullable", "x-..." extensions) are ignored, exactly as the JSON Schema
specification tells validators to do.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from .errors import StructuredOutputError
from .regex_audit import audit_regex

# Enforced by xgrammar (some more narrowly than JSON Schema, which never breaks validity):
# `pattern` / `patternProperties` / `propertyNames.pattern` are matched against the whole string,
# not searched; strict mode forbids properties and items the schema does not name.
ENFORCED = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
    }
)
# Annotations: no effect on validity.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$schema",
        "$id",
        "$anchor",
        "$vocabulary",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
        "contentSchema",
    }
)
# In the JSON Schema vocabulary, but xgrammar 0.2.9 ignores them (or, for `contains`, mis-enforces).
REFUSED = {
    "not": "xgrammar ignores 'not'",
    "uniqueItems": "xgrammar ignores 'uniqueItems' (duplicates would be generated)",
    "if": "xgrammar ignores 'if'/'then'/'else'",
    "then": "xgrammar ignores 'if'/'then'/'else'",
    "else": "xgrammar ignores 'if'/'then'/'else'",
    "dependentRequired": "xgrammar ignores 'dependentRequired'",
    "dependentSchemas": "xgrammar ignores 'dependentSchemas'",
    "dependencies": "xgrammar ignores 'dependencies'",
    "contains": "xgrammar mis-enforces 'contains' (only the empty array is produced)",
    "minContains": "xgrammar does not support 'minContains'",
    "maxContains": "xgrammar does not support 'maxContains'",
    "$dynamicRef": "xgrammar does not resolve '$dynamicRef'",
    "$dynamicAnchor": "xgrammar does not resolve '$dynamicAnchor'",
    "$recursiveRef": "xgrammar does not resolve '$recursiveRef'",
    "$recursiveAnchor": "xgrammar does not resolve '$recursiveAnchor'",
}
# String formats xgrammar 0.2.9 enforces exactly (or more narrowly than RFC 3339/3986/5321 etc.).
_XGRAMMAR_FORMATS = frozenset(
    {
        "email",
        "time",
        "uuid",
        "hostname",
        "uri",
        "uri-reference",
        "duration",
        "json-pointer",
        "relative-json-pointer",
        "uri-template",
    }
)
# Formats xgrammar enforces too loosely ("2021-02-30", "01.2.3.4"): we send our own exact pattern.
_YEAR = r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    rf"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    rf"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])|{_LEAP_YEAR}-02-29)"
)
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
FORMAT_PATTERNS = {
    "date": _DATE,
    "date-time": rf"{_DATE}[Tt]{_TIME}",
    "ipv4": rf"{_OCTET}(\.{_OCTET}){{3}}",
}
ENFORCED_FORMATS = _XGRAMMAR_FORMATS | frozenset(FORMAT_PATTERNS)

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


def _pointer_token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def audit_json_schema(schema: Any) -> Any:
    """Raise StructuredOutputError for the first construct xgrammar would not enforce.

    Returns the schema to compile: a copy in which the formats of FORMAT_PATTERNS are replaced by
    exact `pattern`s (the user's schema is not modified).
    """
    schema = copy.deepcopy(schema)
    auditor = _Auditor(schema)
    auditor.visit(schema, "")
    for node in auditor.rewrite:
        node["pattern"] = FORMAT_PATTERNS[node.pop("format")]
    return schema


class _Auditor:
    def __init__(self, root: Any):
        self.root = root
        self.rewrite: list[dict] = []  # nodes whose `format` becomes our exact pattern

    def fail(self, pointer: str, reason: str) -> None:
        raise StructuredOutputError("schema", reason, pointer or "/")

    def visit(self, node: Any, ptr: str) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            self.fail(ptr, f"a schema must be an object or a boolean, got {type(node).__name__}")
        for key in node:
            if key in REFUSED:
                self.fail(f"{ptr}/{_pointer_token(key)}", f"keyword {key!r} is refused: {REFUSED[key]}")
        self.check_local_rules(node, ptr)
        for key in _SCHEMA_MAPS:
            sub = node.get(key)
            if isinstance(sub, dict):
                for name, child in sub.items():
                    if key == "patternProperties":
                        audit_regex(name, where=f"{ptr}/patternProperties key {name!r} ")
                    self.visit(child, f"{ptr}/{key}/{_pointer_token(name)}")
            elif sub is not None:
                self.fail(f"{ptr}/{key}", f"{key!r} must be an object")
        for key in _SCHEMA_VALUES:
            if key in node:
                self.visit(node[key], f"{ptr}/{key}")
        for key in _SCHEMA_LISTS:
            if key in node:
                items = node[key]
                if not isinstance(items, list) or not items:
                    self.fail(f"{ptr}/{key}", f"{key!r} must be a non-empty array of schemas")
                for i, child in enumerate(items):
                    self.visit(child, f"{ptr}/{key}/{i}")

    def check_local_rules(self, node: dict, ptr: str) -> None:
        if "pattern" in node:
            if not isinstance(node["pattern"], str):
                self.fail(f"{ptr}/pattern", "'pattern' must be a string")
            if "minLength" in node or "maxLength" in node:
                self.fail(
                    f"{ptr}/pattern",
                    "'pattern' together with 'minLength'/'maxLength' is refused: "
                    "xgrammar ignores the length bounds then; put the length into the pattern",
                )
            audit_regex(node["pattern"], where=f"{ptr}/pattern ")
        if "format" in node and node["format"] not in ENFORCED_FORMATS:
            self.fail(
                f"{ptr}/format",
                f"format {node['format']!r} is not enforced by xgrammar; "
                f"supported formats: {sorted(ENFORCED_FORMATS)}",
            )
        if node.get("format") in FORMAT_PATTERNS:
            if any(k in node for k in ("pattern", "minLength", "maxLength")):
                self.fail(
                    f"{ptr}/format",
                    f"format {node['format']!r} cannot be combined with "
                    "'pattern', 'minLength' or 'maxLength'",
                )
            self.rewrite.append(node)
        if "required" in node:
            required = node["required"]
            props = node.get("properties", {})
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                self.fail(f"{ptr}/required", "'required' must be an array of strings")
            missing = [r for r in required if not isinstance(props, dict) or r not in props]
            if missing:
                self.fail(
                    f"{ptr}/required",
                    f"required properties {missing} are not listed in "
                    "'properties'; xgrammar would not generate them",
                )
        if "multipleOf" in node:
            value = node["multipleOf"]
            if node.get("type") != "integer" or not _is_whole(value) or value <= 0:
                self.fail(
                    f"{ptr}/multipleOf",
                    '\'multipleOf\' is only enforced for "type": "integer" '
                    "with a positive whole-number divisor",
                )
        if "allOf" in node and isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
            self.fail(
                f"{ptr}/allOf",
                "'allOf' with more than one schema is refused: xgrammar enforces "
                "only one of them; merge them into a single schema",
            )
        if "$ref" in node:
            ref = node["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                self.fail(f"{ptr}/$ref", f"only local references '#' or '#/...' are supported, got {ref!r}")
            if self.resolve(ref) is None:
                self.fail(f"{ptr}/$ref", f"reference {ref!r} does not resolve inside the schema")
        if "oneOf" in node and isinstance(node["oneOf"], list):
            branches = node["oneOf"]
            for i in range(len(branches)):
                for j in range(i + 1, len(branches)):
                    if not self.disjoint(branches[i], branches[j], depth=0):
                        self.fail(
                            f"{ptr}/oneOf",
                            f"'oneOf' branches {i} and {j} are not provably disjoint; "
                            "xgrammar would fall back to 'anyOf' and could produce a value "
                            "matching both. Use 'anyOf', or make the branches differ in type, "
                            "in const/enum values, or in a required const/enum property",
                        )

    def resolve(self, ref: str) -> Any:
        node = self.root
        if ref == "#":
            return node
        for raw in ref[2:].split("/"):
            token = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return None
        return node

    # --- oneOf disjointness: sound, not complete. If two branches can never match the same value,
    # anyOf and oneOf mean the same thing, so xgrammar's anyOf fallback is then exact.
    def deref(self, node: Any, depth: int) -> Any:
        while isinstance(node, dict) and "$ref" in node and depth < 16:
            node = self.resolve(node["$ref"])
            depth += 1
        return node

    def disjoint(self, a: Any, b: Any, depth: int) -> bool:
        if depth > 8:
            return False
        a, b = self.deref(a, 0), self.deref(b, 0)
        if not isinstance(a, dict) or not isinstance(b, dict):
            return a is False or b is False
        values_a, values_b = _literal_values(a), _literal_values(b)
        if values_a is not None and values_b is not None:
            return not (set(map(_json_key, values_a)) & set(map(_json_key, values_b)))
        if not (_possible_types(a) & _possible_types(b)):
            return True
        # Objects told apart by a required discriminator property with disjoint schemas.
        props_a, props_b = a.get("properties", {}), b.get("properties", {})
        shared = set(a.get("required", [])) & set(b.get("required", [])) & set(props_a) & set(props_b)
        return any(self.disjoint(props_a[name], props_b[name], depth + 1) for name in shared)


_ALL_TYPES = frozenset({"null", "boolean", "object", "array", "string", "number"})


def _is_whole(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value).is_integer()
    )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _json_key(value: Any) -> Any:
    """A hashable key with JSON equality: 1 == 1.0, but true != 1."""
    kind = _json_type(value)
    if kind == "number":
        return (kind, float(value))
    if kind == "array":
        return (kind, tuple(_json_key(v) for v in value))
    if kind == "object":
        return (kind, tuple(sorted((k, _json_key(v)) for k, v in value.items())))
    return (kind, value)


def _literal_values(node: dict) -> list | None:
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return node["enum"]
    return None


def _possible_types(node: dict) -> frozenset:
    """JSON types a value of this schema may have ("integer" folds into "number")."""
    values = _literal_values(node)
    if values is not None:
        return frozenset(_json_type(v) for v in values)
    declared = node.get("type")
    if declared is None:
        return _ALL_TYPES
    names = [declared] if isinstance(declared, str) else list(declared)
    return frozenset("number" if t == "integer" else t for t in names) & _ALL_TYPES
