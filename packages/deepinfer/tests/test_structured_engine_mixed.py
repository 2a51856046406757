"""Structured output end to end through `LLM.generate`: mixed batches, per-request failures,
and constrained decoding with speculative drafts. Outputs are checked by independent checkers
(`jsonschema`, `re.fullmatch`)."""

import json
import re

import jsonschema
import pytest
from deepinfer import LLM, SamplingParams
from deepinfer.engine.drafting import OracleDrafter
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
# Short documents for the byte-vocabulary V4.1 tests (the recompute runner is O(n^2) per sequence).
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
REGEX = "(yes|no|maybe)-[0-9]{1,3}"


def _json(seed, temperature=1.0, max_tokens=40, schema=SCHEMA):
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        seq_seed=seed,
        so_args={"schema_type": "json_schema", "schema": schema, "max_whitespace": 1},
    )


def _regex(seed, temperature=1.0):
    return SamplingParams(
        temperature=temperature,
        max_tokens=12,
        seq_seed=seed,
        so_args={"schema_type": "regex", "schema": REGEX},
    )


def _check(params, completion):
    assert completion.finish_reason == "stop", (completion.text, completion.finish_reason)
    if params.so_args["schema_type"] == "regex":
        assert re.fullmatch(REGEX, completion.text), completion.text
    else:
        jsonschema.validate(json.loads(completion.text), params.so_args["schema"])


def test_mixed_batch_constrained_free_and_broken(real_vocab_checkpoint):
    free = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seq_seed=5)
    broken_schema = SamplingParams(
        max_tokens=4, so_args={"schema_type": "json_schema", "schema": {"type": "no-such-type"}}
    )
    bad_regex = SamplingParams(max_tokens=4, so_args={"schema_type": "regex", "schema": "(a)\\1"})
    params = [_json(1), free, broken_schema, _regex(2), bad_regex, free]
    with LLM(model=str(real_vocab_checkpoint), block_size=16, max_model_len=128) as llm:
        outs = llm.generate(["Give JSON:"] * len(params), params, use_tqdm=False, raise_on_error=False)
    for p, o in zip(params, outs):
        if p is broken_schema or p is bad_regex:
            assert o.error is not None and o.outputs == [], o
            continue
        assert o.error is None
        if p.so_args is None:
            assert len(o.outputs[0].token_ids) == 6
        else:
            _check(p, o.outputs[0])
    assert "no-such-type" in outs[2].error or "type" in outs[2].error


@pytest.fixture(scope="module")
def v41(tmp_path_factory, share_loaded_models):
    path = make_v41_checkpoint(tmp_path_factory.mktemp("v41-structured"), seed=0)
    return path


def _generate(path, params, nextn, monkeypatch, drafter=None):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", str(nextn))
    with LLM(model=str(path), block_size=16, max_model_len=96) as llm:
        assert llm.engine.num_speculative_tokens == nextn
        if drafter is not None:
            llm.engine.spec.drafter = drafter(llm.engine.model)
        outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
        stats = llm.engine.spec_stats()
    return outs, stats


def test_structured_with_drafts_equals_no_drafts_and_is_valid(v41, monkeypatch):
    """Greedy: drafts (masked per draft row, rejected ones rolled back in the matcher) change nothing.
    The oracle proposes the unconstrained greedy continuation, which the grammar often refuses."""
    params = [_json(0, 0.0, schema=SMALL_SCHEMA), _regex(0, temperature=0.0), _regex(8)]
    plain, _ = _generate(v41, params, 0, monkeypatch)
    for drafter in (None, OracleDrafter):
        spec, stats = _generate(v41, params, 3, monkeypatch, drafter)
        assert stats["verified"] > 0
        for p, a, b in zip(params, plain, spec):
            _check(p, b.outputs[0])
            if p.temperature == 0:
                assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_sampled_structured_with_drafts_valid_over_seeds(v41, monkeypatch):
    params = [_json(100 + s, schema=SMALL_SCHEMA) if s % 2 else _regex(100 + s) for s in range(6)]
    outs, _ = _generate(v41, params, 2, monkeypatch)
    for p, o in zip(params, outs):
        _check(p, o.outputs[0])
