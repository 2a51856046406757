"""so_args: a random model's output obeys the constraint; a bad constraint fails only its request."""

import json
import re

import jsonschema
import pytest
from deepinfer import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
}


@pytest.fixture(scope="module")
def llm(real_vocab_checkpoint):
    with LLM(model=str(real_vocab_checkpoint), block_size=16, max_model_len=128) as llm:
        yield llm


def test_regex_and_json_schema_are_obeyed(llm):
    regex = SamplingParams(
        n=2,
        temperature=1.0,
        max_tokens=12,
        seq_seed=3,
        so_args={"schema_type": "regex", "schema": "(yes|no)!"},
    )
    js = SamplingParams(
        temperature=1.0,
        max_tokens=40,
        seq_seed=4,
        so_args={"schema_type": "json_schema", "schema": SCHEMA, "max_whitespace": 1},
    )
    bad = SamplingParams(max_tokens=4, so_args={"schema_type": "regex", "schema": "(?=lookahead)x"})
    outs = llm.generate(
        ["Answer:", "JSON please:", "Broken:"], [regex, js, bad], use_tqdm=False, raise_on_error=False
    )
    for c in outs[0].outputs:
        assert re.fullmatch("(yes|no)!", c.text), c.text
        assert c.finish_reason == "stop"
    doc = outs[1].outputs[0]
    assert doc.finish_reason == "stop", doc.text
    jsonschema.validate(json.loads(doc.text), SCHEMA)
    assert outs[2].error is not None and "look" in outs[2].error.lower() and outs[2].outputs == []


def test_structured_sync_equals_async(real_vocab_checkpoint):
    p = SamplingParams(
        temperature=1.0, max_tokens=10, seq_seed=9, so_args={"schema_type": "regex", "schema": "[a-z]{2,6}"}
    )
    texts = []
    for use_async in (False, True):
        with LLM(
            model=str(real_vocab_checkpoint), block_size=16, max_model_len=128, async_scheduling=use_async
        ) as llm:
            texts.append([c.text for c in llm.generate(["Word:"], p, use_tqdm=False)[0].outputs])
    assert texts[0] == texts[1] and re.fullmatch("[a-z]{2,6}", texts[0][0])
