"""Bad sampling parameters raise a ValueError that names the field."""

import pytest
from deepinfer_model.sampling import MAX_LOGPROBS, RowParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 1e-300),  # T > 0 whose logits / T overflows float32
        ("temperature", 1e308),  # beyond float32
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("position", -1),
    ],
)
def test_bad_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        RowParams(**{field: value})


def test_seed_must_be_int():
    with pytest.raises(TypeError, match="seq_seed"):
        RowParams(seed=1.5)


def test_valid_edges_are_accepted():
    RowParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, logprobs=MAX_LOGPROBS)
    RowParams(top_k=1, top_p=1e-9, min_p=0.0, logprobs=0)


def test_a_row_with_no_token_left_raises_or_is_flagged():
    """A sampled row whose every token is banned: ValueError by default; with `defer_checks` the sampler
    reads nothing back, flags that row alone in `empty_rows` and still draws the other rows exactly as
    they are drawn without it."""
    import torch
    from deepinfer_model.sampling import EMPTY_ROW_MESSAGE, Sampler

    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    rows = [
        RowParams(temperature=0.7, seed=1, position=4),
        RowParams(temperature=0.9, seed=2, position=4, banned_token_ids=tuple(range(vocab))),
        RowParams(temperature=0.0),
    ]
    sampler = Sampler()
    with pytest.raises(ValueError, match="no token left"):
        sampler(logits, rows)
    out = sampler(logits, rows, defer_checks=True)
    assert out.empty_rows.tolist() == [False, True, False]
    alone = sampler(logits[[0, 2]], [rows[0], rows[2]])
    assert out.token_ids[[0, 2]].tolist() == alone.token_ids.tolist()
    assert alone.empty_rows is None and "no token left" in EMPTY_ROW_MESSAGE


def test_a_greedy_row_with_no_token_left_fails_like_a_sampled_one():
    """A greedy row whose every token is banned (or disallowed by its grammar) has no argmax to take:
    flagged with `defer_checks` (the other rows keep their tokens), ValueError without; a greedy row with
    one token left takes that token."""
    import torch
    from deepinfer_model.sampling import Sampler, TokenBitmask

    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    rows = [
        RowParams(temperature=0.0),
        RowParams(temperature=0.0, banned_token_ids=tuple(range(vocab))),
        RowParams(temperature=0.0, banned_token_ids=tuple(t for t in range(vocab) if t != 17)),
    ]
    sampler = Sampler()
    with pytest.raises(ValueError, match="no token left"):
        sampler(logits, rows)
    out = sampler(logits, rows, defer_checks=True)
    assert out.empty_rows.tolist() == [False, True, False]
    assert out.token_ids[0] == int(torch.argmax(logits[0])) and out.token_ids[2] == 17
    # a grammar mask that allows nothing: same for a greedy and a sampled row beside a free one
    nothing = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32)
    mixed = [RowParams(temperature=0.0), RowParams(temperature=0.8, seed=3, position=2), RowParams()]
    out = sampler(logits, mixed, allowed=TokenBitmask(nothing, (0, 1)), defer_checks=True)
    assert out.empty_rows.tolist() == [True, True, False]
