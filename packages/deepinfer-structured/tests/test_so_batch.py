"""Mixed batches: structured and free rows together; masks filled in one call and applied in place
only to the structured rows; the result checked against a float64 NumPy reference."""

from __future__ import annotations

import json
import re

import deepinfer_structured as ds
import numpy as np
import pytest
import torch
import xgrammar as xg
from so_common import EOS_ID, VOCAB_SIZE, deepseek_tokenizer_json
from so_random_model import RandomModel, closing_ids

WORDS = ds.bitmask_words(VOCAB_SIZE)


def reference_apply(logits: np.ndarray, bitmask: np.ndarray, rows: list[int]) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for r in rows:
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


def test_apply_matches_numpy_reference_on_chosen_rows():
    gen = torch.Generator().manual_seed(0)
    vocab = 300  # small so the per-element reference stays fast; not a multiple of 32
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (6, ds.bitmask_words(vocab)), generator=gen, dtype=torch.int32
    )
    for rows in ([1, 4, 5], [0, 1, 2], [3]):
        expect = reference_apply(logits.numpy(), bitmask.numpy(), rows)
        for fn in ("apply_bitmask_inplace", "torch", "xgrammar-cpu-kernel"):
            got = logits.clone()
            if fn == "apply_bitmask_inplace":  # on the CPU: our torch expansion, not xgrammar's kernel
                ds.apply_bitmask_inplace(got, ds.StepMasks(bitmask, rows))
            elif fn == "torch":
                ds.apply_bitmask_torch(got, bitmask, rows)
            else:
                xg.apply_token_bitmask_inplace(got, bitmask, vocab_size=vocab, indices=rows, backend="cpu")
            np.testing.assert_array_equal(got.double().numpy(), expect)


def test_apply_rejects_a_mismatched_width():
    masks = ds.StepMasks(torch.zeros(2, ds.bitmask_words(100), dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="LM-head width"):
        ds.apply_bitmask_inplace(torch.zeros(2, 200), masks)


def test_padded_lm_head_never_allows_padding_ids(service):
    padded = VOCAB_SIZE + 512  # LM head wider than the tokenizer
    info = ds.tokenizer_info_from_file(deepseek_tokenizer_json(), padded)
    svc = ds.GrammarCompileService(info, max_threads=1)
    for args in ({"schema_type": "json_object"}, {"schema_type": "regex", "schema": ".*"}):
        state = svc.new_state(args)
        masks = ds.BatchMasker(padded, max_threads=1).fill([ds.MaskRequest(state, 0)], num_rows=1)
        allowed = ds.unpack_bitmask(masks.bitmask, padded)[0]
        assert allowed.shape[0] == padded
        assert not allowed[VOCAB_SIZE:].any()
        assert allowed[:VOCAB_SIZE].any()
    svc.shutdown()


def test_mixed_batch_generation(service, tokenizer):
    """Eight sequences, four constrained (different types, one with a trigger) and four free,
    decoded step by step with one batched fill + apply per step."""
    model = RandomModel(VOCAB_SIZE, EOS_ID, closing_ids(tokenizer))
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    trigger = tokenizer.encode("<<", add_special_tokens=False).ids
    specs = [
        {"schema_type": "json_schema", "schema": schema, "max_whitespace": 1},
        None,
        {"schema_type": "regex", "schema": r"[a-z]{3}-[0-9]{2}"},
        None,
        {"schema_type": "json", "schema": json.dumps(schema), "any_whitespace": False},
        None,
        {"schema_type": "regex", "schema": r"(yes|no)", "trigger_token_ids": trigger},
        None,
    ]
    states = [service.new_state(s) if s else None for s in specs]
    outputs: list[list[int]] = [[] for _ in specs]
    done = [False] * len(specs)
    masker = ds.BatchMasker(VOCAB_SIZE)
    for step in range(48):
        if step == 2:  # the trigger row meets its trigger in its free text
            outputs[6] += trigger
            states[6].accept_verified(trigger)
        live = [i for i in range(len(specs)) if not done[i]]
        if not live:
            break
        logits = torch.stack([model.logits(100 + i, outputs[i]) for i in live])
        raw = logits.clone()
        requests = [ds.MaskRequest(states[i], row) for row, i in enumerate(live) if states[i] is not None]
        masks = masker.fill(requests, num_rows=len(live))
        ds.apply_bitmask_inplace(logits, masks)
        for row, i in enumerate(live):
            if states[i] is None or row not in masks.rows:
                assert torch.equal(logits[row], raw[row])  # free rows are untouched
            token = int(logits[row].argmax())
            if states[i] is not None:
                states[i].accept_verified([token])
            if token == EOS_ID or (states[i] is None and step == 7):
                done[i] = True
            else:
                outputs[i].append(token)
    texts = [tokenizer.decode(o, skip_special_tokens=False) for o in outputs]
    assert all(done), texts
    assert json.loads(texts[0])["n"] in range(100)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", texts[2])
    assert re.fullmatch(r"\{\"n\": [0-9]{1,2}\}", texts[4])  # any_whitespace=False: xgrammar uses ": "
    free_part, _, structured = texts[6].partition("<<")
    assert re.fullmatch("(yes|no)", structured), texts[6]
    # Free rows ran on raw logits (checked every step above) and produced text.
    assert all(outputs[i] for i in (1, 3, 5, 7))


def test_batch_fill_equals_one_by_one_fill(service, tokenizer):
    args = [
        {"schema_type": "regex", "schema": r"[a-c]+x"},
        {"schema_type": "json_object"},
        {"schema_type": "ebnf", "schema": 'root ::= "a" root | "b"'},
    ]
    states = [service.new_state(a) for a in args]
    prefixes = ["ab", '{"k": [1', "aa"]
    for st, p in zip(states, prefixes):
        st.accept_verified(tokenizer.encode(p, add_special_tokens=False).ids)
    masks = ds.BatchMasker(VOCAB_SIZE).fill(
        [ds.MaskRequest(st, 2 * i) for i, st in enumerate(states)], num_rows=6
    )
    assert masks.rows == [0, 2, 4]
    single = torch.zeros(1, WORDS, dtype=torch.int32)
    for i, st in enumerate(states):
        st.fill_next_token_bitmask(single, 0)
        assert torch.equal(masks.bitmask[2 * i], single[0])


def test_fill_checks_row_ranges(service):
    state = service.new_state({"schema_type": "regex", "schema": "a"})
    with pytest.raises(ValueError, match="outside"):
        ds.BatchMasker(VOCAB_SIZE).fill([ds.MaskRequest(state, 1, [5, 6])], num_rows=3)


@pytest.mark.gpu
def test_apply_on_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, VOCAB_SIZE, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (8, WORDS), generator=gen, dtype=torch.int32)
    masks = ds.StepMasks(bitmask, [0, 3, 7])
    cpu = logits.clone()
    ds.apply_bitmask_inplace(cpu, masks)
    gpu = logits.cuda()
    ds.apply_bitmask_inplace(gpu, masks)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=0)
    fallback = logits.cuda()
    ds.apply_bitmask_torch(fallback, bitmask.cuda(), masks.rows)
    torch.testing.assert_close(fallback.cpu(), cpu, rtol=0, atol=0)
