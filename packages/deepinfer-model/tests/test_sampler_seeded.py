"""Seeded sampling: the token is a pure function of (seq_seed, position, purpose) and the row's logits."""

import torch
from deepinfer_model.sampling import Purpose, RowParams, Sampler, stream_uniform

VOCAB = 1000


def _logits(n, seed):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_same_row_same_token_whatever_the_batch():
    target_logits = _logits(1, 0)
    target = RowParams(temperature=0.9, top_p=0.95, top_k=200, seed=987654321, position=42)
    alone = Sampler()(target_logits, [target]).token_ids.item()
    for batch_seed, size, where in [(1, 7, 0), (2, 33, 16), (3, 64, 63), (4, 2, 1)]:
        logits = _logits(size, batch_seed)
        logits[where] = target_logits[0]
        rows = [
            RowParams(
                temperature=0.5 + 0.1 * (i % 7),
                top_k=(i % 5) * 10 or -1,
                min_p=0.01 * (i % 3),
                seed=i,
                position=i,
            )
            for i in range(size)
        ]
        rows[where] = target
        assert Sampler()(logits, rows).token_ids[where].item() == alone


def test_seed_position_purpose_all_change_the_draw():
    u = stream_uniform(5, 10, Purpose.SAMPLE)
    assert u == stream_uniform(5, 10, Purpose.SAMPLE)
    others = {stream_uniform(6, 10), stream_uniform(5, 11), stream_uniform(5, 10, Purpose.ACCEPT)}
    assert u not in others and len(others) == 3
    # seeds are 64-bit: -1 and 2**64 - 1 are the same seed (reference semantics)
    assert RowParams(seed=-1).seed == 2**64 - 1


def test_different_seeds_give_different_sequences():
    logits = torch.zeros(1, VOCAB)  # uniform distribution: every draw differs with high probability
    seqs = []
    for seed in (1, 2):
        seqs.append(
            [Sampler()(logits, [RowParams(seed=seed, position=p)]).token_ids.item() for p in range(20)]
        )
    assert seqs[0] != seqs[1]


def test_mixed_parameters_in_one_batch_match_each_alone():
    logits = _logits(6, 7)
    rows = [
        RowParams(temperature=0.0),
        RowParams(temperature=1.0, seed=1, position=3),
        RowParams(temperature=0.3, top_k=5, seed=2, position=3),
        RowParams(top_p=0.5, seed=3, position=9),
        RowParams(min_p=0.2, temperature=1.5, seed=4, position=1),
        RowParams(top_k=1, seed=5),
    ]
    batched = Sampler()(logits, rows).token_ids.tolist()
    alone = [Sampler()(logits[i : i + 1], [r]).token_ids.item() for i, r in enumerate(rows)]
    assert batched == alone
    assert batched[5] == int(torch.argmax(logits[5]))
