"""Bad so_args, schemas, regexes and grammars fail their request alone with a clear
StructuredOutputError (a ValueError) naming the field and the location. The audit table keeps the
evidence of what xgrammar 0.2.9 silently ignores: for each refused construct, raw xgrammar accepts
a value that jsonschema says violates the schema."""

from __future__ import annotations

import json

import deepinfer_structured as ds
import jsonschema
import pytest
import torch
import xgrammar as xg
from so_common import EOS_ID, VOCAB_SIZE, deepseek_tokenizer_json


@pytest.fixture(scope="module")
def raw_compiler(tokenizer_info):
    return xg.GrammarCompiler(tokenizer_info, max_threads=1)


def raw_accepts(raw_compiler, schema, text) -> bool:
    matcher = xg.GrammarMatcher(raw_compiler.compile_json_schema(json.dumps(schema)))
    return matcher.accept_string(text) and matcher.accept_token(EOS_ID)


# (name, schema, a value raw xgrammar generates although it violates the schema, pointer we name)
IGNORED_BY_XGRAMMAR = [
    (
        "uniqueItems",
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "[1,1]",
        "/uniqueItems",
    ),
    ("not", {"type": "integer", "not": {"const": 3}}, "3", "/not"),
    ("required-without-properties", {"type": "object", "required": ["a"]}, "{}", "/required"),
    (
        "required-not-in-properties",
        {"type": "object", "properties": {"b": {}}, "required": ["a"]},
        '{"b":1}',
        "/required",
    ),
    ("oneOf-overlapping", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", "/oneOf"),
    (
        "oneOf-overlapping-ranges",
        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 9}]},
        "5",
        "/oneOf",
    ),
    (
        "allOf-two",
        {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 9}]},
        "20",
        "/allOf",
    ),
    ("contains", {"type": "array", "contains": {"const": 1}}, "[]", "/contains"),
    ("if-then", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "9", "/if"),
    (
        "dependentRequired",
        {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
        '{"a":1}',
        "/dependentRequired",
    ),
    ("multipleOf-number", {"type": "number", "multipleOf": 0.5}, "1.25", "/multipleOf"),
    ("pattern-with-maxLength", {"type": "string", "pattern": "a+", "maxLength": 2}, '"aaa"', "/pattern"),
    ("lookahead-in-pattern", {"type": "string", "pattern": "(?!b)[ab]"}, '"b"', "/pattern position 0"),
    ("ipv6-leading-zero", {"type": "string", "format": "ipv6"}, '"::ffff:1.1.1.01"', "/format"),
    (
        "nested",
        {
            "type": "object",
            "properties": {"x": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
            "required": ["x"],
        },
        '{"x":[1,1]}',
        "/properties/x/uniqueItems",
    ),
]


@pytest.mark.parametrize(
    ("schema", "violating", "pointer"),
    [c[1:] for c in IGNORED_BY_XGRAMMAR],
    ids=[c[0] for c in IGNORED_BY_XGRAMMAR],
)
def test_refused_constructs_are_really_ignored_by_xgrammar(raw_compiler, schema, violating, pointer):
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    assert not checker.is_valid(json.loads(violating))  # the value violates the user's schema ...
    assert raw_accepts(raw_compiler, schema, violating)  # ... yet raw xgrammar would generate it
    with pytest.raises(ds.StructuredOutputError) as info:
        ds.parse_so_args({"schema_type": "json_schema", "schema": schema})
    assert info.value.field == "schema"
    assert info.value.location is not None and info.value.location.startswith(pointer), info.value
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("fmt", ["blah", "int32", "iri", "regex"])
def test_formats_xgrammar_does_not_enforce_are_refused(fmt):
    with pytest.raises(ds.StructuredOutputError, match=f"format '{fmt}'"):
        ds.parse_so_args({"schema_type": "json", "schema": {"type": "string", "format": fmt}})


@pytest.mark.parametrize(
    ("fmt", "bad", "good"),
    [
        ("date", "2021-02-30", "2024-02-29"),
        ("ipv4", "01.2.3.4", "10.2.3.4"),
        ("date-time", "2021-02-30T00:00:00Z", "2021-02-28T23:59:59Z"),
    ],
)
def test_loose_xgrammar_formats_are_made_exact(service, raw_compiler, fmt, bad, good):
    schema = {"type": "string", "format": fmt}
    assert raw_accepts(raw_compiler, schema, json.dumps(bad))  # xgrammar alone is too loose
    for value, ok in ((bad, False), (good, True)):
        state = service.new_state({"schema_type": "json_schema", "schema": schema})
        assert (state.matcher.accept_string(json.dumps(value)) and state.accept_token(EOS_ID)) is ok


@pytest.mark.parametrize(
    "schema",
    [
        {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
        {"oneOf": [{"const": 1}, {"const": 1.5}, {"enum": [True, "1"]}]},
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                    "required": ["kind"],
                },
                {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]},
            ]
        },
        {"$defs": {"i": {"type": "integer"}}, "oneOf": [{"$ref": "#/$defs/i"}, {"type": "boolean"}]},
    ],
)
def test_provably_disjoint_oneof_is_accepted(service, schema):
    service.compile({"schema_type": "json_schema", "schema": schema})


def test_oneof_integer_versus_true_is_disjoint_but_one_versus_one_point_oh_is_not():
    ds.parse_so_args({"schema_type": "json", "schema": {"oneOf": [{"const": True}, {"const": 1}]}})
    with pytest.raises(ds.StructuredOutputError, match="not provably disjoint"):
        ds.parse_so_args({"schema_type": "json", "schema": {"oneOf": [{"const": 1.0}, {"enum": [2, 1]}]}})


@pytest.mark.parametrize(
    ("so_args", "field", "message"),
    [
        ("json", "so_args", "must be a dict"),
        ({"schema_type": "xml", "schema": "x"}, "schema_type", "must be one of"),
        ({"schema_type": "regex", "schema": "a", "serialized": "..."}, "serialized", "precompiled"),
        (
            {"schema_type": "regex", "schema": "a", "bound_token_ids": [1]},
            "bound_token_ids",
            "bound_token_id",
        ),
        ({"schema_type": "regex", "schema": "a", "temperature": 1}, "temperature", "unknown key"),
        ({"schema_type": "regex", "schema": "a", "bound_token_id": 3}, "bound_token_id", "non-empty"),
        (
            {"schema_type": "regex", "schema": "a", "trigger_token_ids": [1, -2]},
            "trigger_token_ids",
            "non-negative",
        ),
        (
            {"schema_type": "regex", "schema": "a", "trigger_token_ids": [1], "bound_token_id": True},
            "bound_token_id",
            "non-negative int",
        ),
        ({"schema_type": "regex", "schema": ""}, "schema", "non-empty string"),
        ({"schema_type": "ebnf", "schema": {"root": "a"}}, "schema", "non-empty string"),
        ({"schema_type": "json_object", "schema": {"type": "object"}}, "schema", "absent"),
        ({"schema_type": "regex", "schema": "a", "any_whitespace": False}, "any_whitespace", "only to JSON"),
        ({"schema_type": "json_object", "max_whitespace": 0}, "max_whitespace", ">= 1"),
        ({"schema_type": "json", "schema": 5}, "schema", "JSON schema"),
        (
            {"schema_type": "json", "schema": {"type": "object", "properties": []}},
            "schema",
            "'properties' must be",
        ),
    ],
)
def test_bad_so_args(so_args, field, message):
    with pytest.raises(ds.StructuredOutputError, match=message) as info:
        ds.parse_so_args(so_args)
    assert info.value.field == field


def test_malformed_json_text_names_line_and_column():
    with pytest.raises(ds.StructuredOutputError, match="not valid JSON") as info:
        ds.parse_so_args({"schema_type": "json", "schema": '{"type":\n "object",}'})
    assert info.value.location == "line 2, column 11"


def test_reference_and_our_spellings_share_one_compile():
    ours = ds.parse_so_args(
        {"schema_type": "json_schema", "schema": {"type": "object", "properties": {"b": {}}}}
    )
    ref = ds.parse_so_args(
        {"schema_type": "json", "schema": '{ "type" : "object",\n "properties": {"b": {}} }'}
    )
    assert ours.cache_key == ref.cache_key
    assert ds.parse_so_args({"schema_type": "grammar", "schema": 'root ::= "a"'}).schema_type == "ebnf"
    reordered = ds.parse_so_args(
        {"schema_type": "json", "schema": {"properties": {"b": {}}, "type": "object"}}
    )
    assert reordered.cache_key != ours.cache_key  # key order is kept: it decides generation order


@pytest.mark.parametrize(
    ("regex", "what", "position"),
    [
        ("a(?=b)b", "lookahead", 1),
        ("(?<=a)b", "lookbehind", 0),
        (r"(a)\1", "backreference", 3),
        (r"\Aabc", r"escape \\A", 0),
        ("a^b", "'\\^' anchor", 1),
        ("a$b", "'\\$' anchor", 1),
        ("(?i)abc", "inline flags", 0),
        (r"\bword", r"escape \\b", 0),
        ("(ab", "invalid regex", 0),
        (r"\p{L}", r"escape \\p", 0),
    ],
)
def test_unsupported_regex_is_refused_with_position(regex, what, position):
    with pytest.raises(ds.StructuredOutputError, match=what) as info:
        ds.parse_so_args({"schema_type": "regex", "schema": regex})
    assert info.value.location == f"position {position}"


@pytest.mark.parametrize(
    ("grammar", "location"),
    [
        ('root ::= "a" | ', "line 1, column 16"),
        ("root ::= foo", "line 1, column 10"),
        ('root ::= "a"\nroot ::= "b"', "line 2, column 1"),
        ("root ::= [a-z", "line 1, column 14"),
    ],
)
def test_bad_ebnf_reports_xgrammars_message_and_location(service, grammar, location):
    pending = service.submit({"schema_type": "ebnf", "schema": grammar})
    with pytest.raises(ds.StructuredOutputError, match="EBNF") as info:
        pending.result()
    assert info.value.location == location
    assert "/project/" not in str(info.value)  # xgrammar's source path prefix is stripped


def test_schema_xgrammar_rejects_reports_its_message(service):
    with pytest.raises(ds.StructuredOutputError, match='Unsupported type "foo"'):
        service.compile({"schema_type": "json", "schema": {"type": "foo"}})
    with pytest.raises(ds.StructuredOutputError, match="does not resolve"):
        ds.parse_so_args({"schema_type": "json", "schema": {"$ref": "#/$defs/nope"}})
    with pytest.raises(ds.StructuredOutputError, match="only local references"):
        ds.parse_so_args({"schema_type": "json", "schema": {"$ref": "http://example.com/s.json"}})


def test_one_bad_request_does_not_affect_the_others(service, tokenizer):
    pendings = [
        service.submit({"schema_type": "regex", "schema": "[0-9]{2}"}),
        service.submit({"schema_type": "ebnf", "schema": "root ::= nope"}),
        service.submit({"schema_type": "json_object"}),
    ]
    assert pendings[0].result() is not None and pendings[2].result() is not None
    with pytest.raises(ds.StructuredOutputError):
        pendings[1].result()
    with pytest.raises(ds.StructuredOutputError):  # the failure is cached and still per-request
        pendings[1].poll()
    state = ds.GrammarState(pendings[0].result(), pendings[0].request)
    state.accept_verified(tokenizer.encode("42", add_special_tokens=False).ids + [EOS_ID])
    assert state.is_terminated()


def test_compile_timeout_fails_only_that_request(tokenizer_info):
    svc = ds.GrammarCompileService(tokenizer_info, max_threads=1, timeout_s=0.001)
    big = {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "format": "email"} for i in range(30)},
        "required": [f"k{i}" for i in range(30)],
    }
    with pytest.raises(ds.StructuredOutputError, match="compile timeout"):
        svc.compile({"schema_type": "json", "schema": big})
    svc.shutdown()


def test_poll_returns_none_until_compiled_then_the_grammar(service):
    pending = service.submit({"schema_type": "regex", "schema": "[a-f]{1,9}z"})
    compiled = pending.result()
    assert pending.poll() is compiled


def test_cache_hits_on_same_schema_and_misses_on_other_options(tokenizer_info):
    svc = ds.GrammarCompileService(tokenizer_info, max_threads=1, cache_entries=2)
    a = {"schema_type": "json", "schema": '{"type": "integer"}'}
    first = svc.compile(a)
    assert svc.compile({"schema_type": "json_schema", "schema": {"type": "integer"}}) is first
    assert svc.stats.hits == 1 and svc.stats.misses == 1
    svc.compile({**a, "any_whitespace": False})
    svc.compile({"schema_type": "regex", "schema": "x"})
    assert svc.stats.misses == 3 and svc.stats.entries == 2  # LRU bound
    svc.shutdown()


def test_trigger_outside_the_vocabulary_is_refused(service):
    with pytest.raises(ds.StructuredOutputError, match="outside the vocabulary"):
        service.submit({"schema_type": "regex", "schema": "a", "trigger_token_ids": [VOCAB_SIZE]})


def test_bound_outside_the_vocabulary_is_named_as_the_bound(service):
    so = {"schema_type": "regex", "schema": "a", "trigger_token_ids": [5], "bound_token_id": VOCAB_SIZE + 5}
    with pytest.raises(ds.StructuredOutputError, match="outside the vocabulary") as err:
        service.submit(so)
    assert err.value.field == "bound_token_id" and str(VOCAB_SIZE + 5) in str(err.value)


def test_tokenizer_info_arguments_are_checked():
    with pytest.raises(ValueError, match="vocab_size"):
        ds.tokenizer_info_from_file(deepseek_tokenizer_json(), 0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        ds.tokenizer_info_from_file(deepseek_tokenizer_json(), 100, stop_token_ids=[100])


def test_special_tokens_are_never_allowed_inside_text(service):
    """BOS and other special tokens must not appear as literal text inside a JSON string."""
    state = service.new_state({"schema_type": "json", "schema": {"type": "string"}})
    assert state.matcher.accept_string('"ab')
    row = torch.zeros(1, ds.bitmask_words(VOCAB_SIZE), dtype=torch.int32)
    state.fill_next_token_bitmask(row, 0)
    allowed = ds.unpack_bitmask(row, VOCAB_SIZE)[0]
    assert not allowed[0] and not allowed[EOS_ID] and allowed.sum() > 100000


def test_cache_byte_limit_drops_least_recently_used(tokenizer_info):
    svc = ds.GrammarCompileService(tokenizer_info, max_threads=1, cache_limit_bytes=1)
    svc.compile({"schema_type": "regex", "schema": "a+"})
    assert svc.cache_bytes() > 1  # the newest entry always stays
    svc.compile({"schema_type": "regex", "schema": "b+"})
    assert svc.stats.entries == 1
    svc.compile({"schema_type": "regex", "schema": "b+"})
    assert svc.stats.hits == 1
    svc.shutdown()


def test_special_and_out_of_range_drafts_are_rejected_quietly(service, capfd):
    """Drafts often propose special tokens; xgrammar would log a warning line for each."""
    state = service.new_state({"schema_type": "regex", "schema": "a+"})
    for token in (0, 2, VOCAB_SIZE - 1, VOCAB_SIZE, -1):
        assert not state.accept_token(token)
    assert state.num_tokens == 0
    assert "Warning" not in capfd.readouterr().err
