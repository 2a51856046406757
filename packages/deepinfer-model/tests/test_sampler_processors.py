"""vLLM's logits processors (allowed ids, bad words, logit bias, presence / frequency / repetition
penalties) against a naive float64 implementation written from their definitions, on random logits."""

import math
import random

import numpy as np
import pytest
import torch
from deepinfer_model.sampling import (
    RowParams,
    Sampler,
    TokenBitmask,
    bad_word_bans,
    filtered_probs,
    masked_logits,
    process_logits_,
)

VOCAB = 64


def reference(logits: list[float], row: RowParams) -> list[float]:
    """One row processed in float64, token by token, straight from the definitions."""
    x = [float(v) for v in logits]
    out = list(row.output_token_ids)
    if row.allowed_token_ids is not None:
        x = [v if t in row.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for word in row.bad_words:
        before = list(word[:-1])
        if len(before) == 0 or out[len(out) - len(before) :] == before and len(out) >= len(before):
            x[word[-1]] = -math.inf
    for t, b in row.logit_bias:
        x[t] += b
    if row.repetition_penalty != 1.0:
        for t in set(row.prompt_token_ids) | set(out):
            x[t] = x[t] / row.repetition_penalty if x[t] > 0 else x[t] * row.repetition_penalty
    for t in set(out):
        x[t] -= row.frequency_penalty * out.count(t)
        x[t] -= row.presence_penalty
    return x


def random_row(rng: random.Random, **over) -> RowParams:
    prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12)))
    output = tuple(rng.choice([1, 2, 3, rng.randrange(VOCAB)]) for _ in range(rng.randrange(0, 12)))
    words = []
    for _ in range(rng.randrange(0, 4)):  # some bad words end the output on purpose
        n = rng.randrange(1, 4)
        head = list(output[len(output) - n + 1 :]) if rng.random() < 0.5 and len(output) >= n - 1 else []
        words.append(tuple(head or [rng.randrange(VOCAB) for _ in range(n - 1)]) + (rng.randrange(VOCAB),))
    kw = dict(
        temperature=rng.choice([0.0, 0.7, 1.3]),
        seed=rng.randrange(1000),
        position=len(prompt) + len(output),
        allowed_token_ids=tuple(rng.sample(range(VOCAB), 40)) if rng.random() < 0.3 else None,
        bad_words=tuple(words),
        logit_bias=tuple(sorted({rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(3)}.items())),
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 3.0)]),
        prompt_token_ids=prompt,
        output_token_ids=output,
    )
    kw.update(over)
    return RowParams(**kw)


def test_processors_match_a_float64_reference_on_random_rows():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows = [random_row(rng) for _ in range(6)]
        logits = torch.randn(len(rows), VOCAB, generator=gen) * 4
        got = process_logits_(logits.clone(), rows).double()
        want = torch.tensor(
            [reference(logits[i].tolist(), r) for i, r in enumerate(rows)], dtype=torch.float64
        )
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = torch.isfinite(want)
        assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize(
    "field,value",
    [
        ("repetition_penalty", 2.0),
        ("presence_penalty", 1.5),
        ("frequency_penalty", -0.5),
        ("logit_bias", ((5, 3.0), (9, -100.0))),
        ("allowed_token_ids", (1, 4, 9)),
        ("bad_words", ((3,), (2, 7))),
    ],
)
def test_each_processor_alone_matches_the_reference(field, value):
    row = RowParams(prompt_token_ids=(4, 5, 6, 5), output_token_ids=(2, 5, 5, 9), **{field: value})
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    got = process_logits_(logits.clone(), [row])[0].double()
    want = torch.tensor(reference(logits[0].tolist(), row), dtype=torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-6, atol=1e-5)
    assert not torch.equal(got, logits[0].double())  # each one does something on this row


def test_bad_word_bans_match_the_prefix_rule():
    assert bad_word_bans([(7,)], ()) == [7]
    assert bad_word_bans([(1, 2, 3)], (5, 1, 2)) == [3]
    assert bad_word_bans([(1, 2, 3)], (1, 2, 5)) == []
    assert bad_word_bans([(1, 2, 3)], (2,)) == []  # shorter than the bad word's head
    assert bad_word_bans([(4, 4)], (4,)) == [4]


def test_rows_without_processors_are_untouched_and_rows_are_batch_independent():
    rng = random.Random(1)
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    plain = RowParams(temperature=0.8, seed=3, position=4)
    assert not plain.processed
    assert masked_logits(logits, [plain] * 5, None) is logits  # nothing changes, nothing is copied
    rows = [random_row(rng) for _ in range(5)]
    rows[2] = plain
    together = masked_logits(logits, rows, None)
    assert torch.equal(together[2], logits[2])
    for i, r in enumerate(rows):
        assert torch.equal(masked_logits(logits[i : i + 1], [r], None)[0], together[i])


def test_sampler_draws_from_the_processed_distribution():
    """Greedy takes the argmax of the processed logits; a sampled row's filtered distribution is the
    softmax of the processed logits (float64 reference)."""
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    sampler = Sampler()
    for _ in range(10):
        greedy = random_row(rng, temperature=0.0, allowed_token_ids=None)
        sampled = random_row(rng, temperature=0.9, allowed_token_ids=None)
        logits = torch.randn(2, VOCAB, generator=gen) * 3
        ref = [reference(logits[i].tolist(), r) for i, r in enumerate([greedy, sampled])]
        out = sampler(logits, [greedy, sampled])
        assert int(out.token_ids[0]) == int(np.argmax(ref[0]))
        probs = filtered_probs(masked_logits(logits[1:], [sampled], None), [sampled])[0].double()
        z = torch.tensor(ref[1], dtype=torch.float64) / 0.9
        assert torch.allclose(probs, torch.softmax(z, dim=-1), atol=1e-6)
        assert probs[int(out.token_ids[1])] > 0


def test_processors_compose_with_a_grammar_mask():
    """A token the grammar forbids stays forbidden whatever its bias; among the allowed ones the bias
    decides the greedy pick."""
    logits = torch.zeros(1, VOCAB)
    words = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for t in (10, 11, 12):
        words[0, t // 32] |= 1 << (t % 32)
    mask = TokenBitmask(words, (0,))
    row = RowParams(temperature=0.0, logit_bias=((40, 100.0), (11, 5.0)))
    masked = masked_logits(logits, [row], mask)
    assert torch.isinf(masked[0, 40]) and int(torch.argmax(masked[0])) == 11
    assert int(Sampler()(logits, [row], mask).token_ids[0]) == 11
    banned = RowParams(temperature=0.0, bad_words=((11,),), logit_bias=((11, 5.0),))
    assert int(Sampler()(logits, [banned], mask).token_ids[0]) == 10


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e3),
        ("temperature", 1e-300),
        ("temperature", float("inf")),
        ("temperature", 1e308),
    ],
)
def test_bad_processor_fields_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        RowParams(**{field: value})


def test_ids_outside_the_vocabulary_are_refused_by_name():
    logits = torch.zeros(1, VOCAB)
    for field, value in [("allowed_token_ids", (VOCAB,)), ("logit_bias", ((VOCAB, 1.0),))]:
        with pytest.raises(ValueError, match=field):
            process_logits_(logits, [RowParams(**{field: value})])
