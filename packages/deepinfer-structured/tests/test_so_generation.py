"""Outputs of a seeded random model under each constraint, checked by independent checkers:
jsonschema for JSON schemas, json.loads for JSON objects, re.fullmatch for regexes and a
recursive-descent recogniser for EBNF grammars. Real DeepSeek-V4 tokenizer, full-width masks."""

from __future__ import annotations

import datetime
import json
import re

import deepinfer_structured as ds
import jsonschema
import pytest
import torch
from so_common import EOS_ID, VOCAB_SIZE
from so_ebnf_parsers import ARITH_EBNF, CALLS_EBNF, recognises
from so_random_model import RandomModel, closing_ids

SEEDS = range(12)
MAX_TOKENS = 128

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {
            "oneOf": [
                {"type": "integer", "minimum": -5, "maximum": 5},
                {"type": "string", "maxLength": 4},
                {"type": "null"},
            ]
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age"],
}
FORMATS_SCHEMA = {
    "type": "object",
    "properties": {
        "day": {"type": "string", "format": "date"},
        "ip": {"type": "string", "format": "ipv4"},
        "id": {"type": "string", "format": "uuid"},
        "mail": {"type": "string", "format": "email"},
        "code": {"type": "string", "pattern": "[A-Z]{2}[0-9]{2,3}"},
        "at": {"type": "string", "format": "date-time"},
    },
    "required": ["day", "ip", "id", "code", "at"],
}
REGEXES = [
    r"[a-z]{2,6}@[a-z]{2,8}\.(com|org|net)",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)!?",
    r'\{"x": (0|[1-9][0-9]{0,3})\}',
    r"(ab|cd)+x?",
]


@pytest.fixture(scope="module")
def model(tokenizer):
    return RandomModel(VOCAB_SIZE, EOS_ID, closing_ids(tokenizer))


def generate(state: ds.GrammarState, model: RandomModel, seed: int) -> tuple[list[int], bool]:
    """Greedy decode of the random model under the state's masks; (tokens without EOS, ended)."""
    masks = ds.StepMasks(torch.empty(1, ds.bitmask_words(VOCAB_SIZE), dtype=torch.int32), [0])
    tokens: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = model.logits(seed, tokens).unsqueeze(0)
        state.fill_next_token_bitmask(masks.bitmask, 0)
        ds.apply_bitmask_inplace(logits, masks)
        token = int(logits[0].argmax())
        state.accept_verified([token])
        if token == EOS_ID:
            assert state.is_terminated()
            return tokens, True
        tokens.append(token)
    return tokens, False


def run_many(service, tokenizer, model, so_args, check, min_ended: int) -> None:
    state = service.new_state(so_args)
    ended = 0
    for seed in SEEDS:
        state.rebuild_from_tokens([])
        tokens, done = generate(state, model, seed)
        if done:
            ended += 1
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            check(text)
    assert ended >= min_ended, f"only {ended} of {len(SEEDS)} outputs ended within {MAX_TOKENS} tokens"


# A random model loves JSON's many whitespace tokens; without a bound it rarely ends (README).
@pytest.mark.parametrize(
    ("schema", "max_ws"),
    [(PERSON_SCHEMA, 1), (PERSON_SCHEMA, 3), (FORMATS_SCHEMA, 1)],
    ids=["person-ws1", "person-ws3", "formats-ws1"],
)
def test_json_schema_outputs_validate(service, tokenizer, model, schema, max_ws):
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())

    def check(text):
        errors = list(validator.iter_errors(json.loads(text)))
        assert not errors, (text, errors[0].message)
        # An anchored reading of `pattern`: xgrammar matches it against the whole string.
        value = json.loads(text)
        if "code" in schema["properties"]:
            assert re.fullmatch("[A-Z]{2}[0-9]{2,3}", value["code"])
            # jsonschema has no date-time checker without extras; Python's parser is independent.
            datetime.datetime.fromisoformat(value["at"].replace("z", "Z"))

    so_args = {"schema_type": "json_schema", "schema": schema, "max_whitespace": max_ws}
    run_many(service, tokenizer, model, so_args, check, min_ended=len(SEEDS) // 2)


def test_json_object_outputs_parse(service, tokenizer, model):
    def check(text):
        assert isinstance(json.loads(text), dict), text

    run_many(
        service,
        tokenizer,
        model,
        {"schema_type": "json_object", "max_whitespace": 2},
        check,
        min_ended=len(SEEDS) // 2,
    )


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(service, tokenizer, model, pattern):
    def check(text):
        # xgrammar's '.' also matches a newline, hence DOTALL (documented in the README).
        assert re.fullmatch(pattern, text, flags=re.DOTALL), (pattern, text)

    run_many(
        service,
        tokenizer,
        model,
        {"schema_type": "regex", "schema": pattern},
        check,
        min_ended=len(SEEDS) // 2,
    )


@pytest.mark.parametrize("grammar", [ARITH_EBNF, CALLS_EBNF], ids=["arith", "calls"])
def test_ebnf_outputs_parse(service, tokenizer, model, grammar):
    def check(text):
        assert recognises(grammar, text), text

    run_many(
        service,
        tokenizer,
        model,
        {"schema_type": "ebnf", "schema": grammar},
        check,
        min_ended=len(SEEDS) // 2,
    )


def test_recognisers_reject_what_they_should():
    assert recognises(ARITH_EBNF, "1+(23*4)-0")
    assert not recognises(ARITH_EBNF, "01")
    assert not recognises(ARITH_EBNF, "(1")
    assert recognises(CALLS_EBNF, "f(); g_1(a,'x y')")
    assert not recognises(CALLS_EBNF, "f(,)")


def test_unconstrained_model_output_would_fail_the_checkers(tokenizer, model):
    """Guards against a vacuous test: without masks the random model's text is not JSON."""
    tokens = []
    for _ in range(20):
        tokens.append(int(model.logits(0, tokens).argmax()))
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(tokens))
