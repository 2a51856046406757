"""`select_topk`'s 16-bit path (unique integer keys + top-k) picks exactly what the whole-row sort picks.

References: `_select_topk_sorted` (the stable descending sort, on the scores widened to FP64) and a naive
float64 oracle (Python `sorted` by (-score, index) per row). Scores come from a handful of values, both
signed zeros among them, so ties decide most rows; -0.0 and +0.0 are equal scores.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_model import numerics
from deepinfer_model.layers.indexer import _select_topk, _select_topk_sorted, select_topk
from deepinfer_model.models.deepseek_v41.sparse import candidate_blocks
from deepinfer_model.numerics import carrier

NARROW = (torch.bfloat16, torch.float16)
# no -inf: a valid -inf score is where the sort differs from the oracle (test_valid_minus_inf_...)
TIE_VALUES = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -3.0, -6e4, float("inf"), 1e-3]


def _tied_scores(t: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[T, n] scores drawn from TIE_VALUES, every third entry from a wider random range (fewer ties)."""
    vals = torch.tensor(TIE_VALUES)
    s = vals[torch.randint(0, len(vals), (t, n), generator=gen)]
    s[:, ::3] = torch.randn(t, len(range(0, n, 3)), generator=gen) * 4
    return s.to(dtype)


def _random_valid(t: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random masks of mixed density; row 0 has no valid entry, row 1 fewer than k."""
    valid = torch.rand(t, n, generator=gen) < torch.rand(t, 1, generator=gen)
    if t > 1:
        valid[0] = False
    if t > 2:
        valid[1] = False
        valid[1, torch.randperm(n, generator=gen)[: max(k // 2, 0)]] = True
    return valid


def _prefix_valid(t: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """The model's masks: entry j valid iff j < L_row (L_row from 0 to n)."""
    lens = torch.randint(0, n + 1, (t,), generator=gen)
    return torch.arange(n)[None, :] < lens[:, None]


def _oracle(scores: torch.Tensor, valid: torch.Tensor, k: int) -> list[list[int]]:
    out = []
    for row, ok in zip(scores.double().tolist(), valid.tolist(), strict=True):
        cand = [j for j, v in enumerate(ok) if v]
        ranked = sorted(cand, key=lambda j: (-row[j], j))[:k]  # -0.0 == +0.0: tie -> lower index
        out.append(sorted(ranked) + [-1] * (k - len(ranked)))
    return out


def _check(scores: torch.Tensor, valid: torch.Tensor, k: int, oracle: bool = True) -> None:
    got = select_topk(scores, valid, k)
    assert got.dtype is torch.long and got.shape == (scores.shape[0], k)
    assert torch.equal(got, _select_topk_sorted(scores.double(), valid, k))
    if oracle:
        assert got.tolist() == _oracle(scores, valid, k)


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize(
    ("t", "n", "k"), [(41, 300, 64), (17, 40, 64), (9, 1, 1), (23, 1000, 512), (5, 7, 7)]
)
def test_keys_match_sort_and_oracle_with_many_ties(dtype, t, n, k):
    gen = torch.Generator().manual_seed(t * 1000 + n)
    scores = _tied_scores(t, n, dtype, gen)
    _check(scores, _random_valid(t, n, k, gen), k)
    _check(scores, _prefix_valid(t, n, gen), k)
    _check(scores, torch.ones(t, n, dtype=torch.bool), k)


@pytest.mark.parametrize("dtype", NARROW)
def test_empty_rows_and_entries(dtype):
    assert (
        select_topk(torch.zeros(3, 0, dtype=dtype), torch.zeros(3, 0, dtype=torch.bool), 4).tolist()
        == [[-1] * 4] * 3
    )
    assert select_topk(torch.zeros(0, 5, dtype=dtype), torch.zeros(0, 5, dtype=torch.bool), 4).shape == (0, 4)
    assert select_topk(torch.zeros(2, 5, dtype=dtype), torch.ones(2, 5, dtype=torch.bool), 0).shape == (2, 0)


@pytest.mark.parametrize("dtype", NARROW)
def test_signed_zeros_tie_and_ties_go_to_the_lower_index(dtype):
    s = torch.tensor([[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0], [-0.0, -0.0, -0.0], [1.0, 1.0, 1.0]], dtype=dtype)
    valid = torch.ones_like(s, dtype=torch.bool)
    assert select_topk(s, valid, 1).tolist() == [[0], [0], [0], [0]]
    assert select_topk(s, valid, 2).tolist() == [[0, 1]] * 4
    # the row's best entries beat the tie-break: -0.0 loses only to positive scores, never to +0.0
    s = torch.tensor([[-0.0, -(2.0**-10), 0.0, 2.0**-10]], dtype=dtype)
    assert select_topk(s, torch.ones_like(s, dtype=torch.bool), 2).tolist() == [[0, 3]]


@pytest.mark.parametrize("dtype", NARROW)
def test_more_than_two_to_the_sixteen_entries_use_wide_keys(dtype):
    gen = torch.Generator().manual_seed(11)
    t, n, k = 3, (1 << 16) + 37, 64
    scores = _tied_scores(t, n, dtype, gen)
    scores[:, -50:] = 2.0  # ties at the high indices the int32 keys could not hold
    scores[2, :] = 2.0
    valid = _prefix_valid(t, n, gen)
    valid[1] = True
    valid[2, : n - 20] = False  # only indices above 2^16 valid, fewer than k
    _check(scores, valid, k)


@pytest.mark.parametrize("dtype", NARROW)
def test_exactly_two_to_the_sixteen_entries(dtype):
    t, n, k = 2, 1 << 16, 32
    scores = torch.zeros(t, n, dtype=dtype)
    scores[0, n - 5 :] = 1.0  # index 65535 (key low bits 0) among the best
    valid = torch.ones(t, n, dtype=torch.bool)
    valid[1, : n - 3] = False  # only the top indices valid
    _check(scores, valid, k)


def test_valid_minus_inf_scores_are_picked_before_invalid_entries():
    """The oracle's semantics: a valid -inf score is a valid entry. (The sort masks invalid entries with
    -inf, so there a valid -inf entry is ranked among them by index and may be dropped; index scores and
    valid candidate-block scores are never -inf.)"""
    inf = float("inf")
    scores = torch.tensor(
        [[-inf, -inf, -inf, 1.0, -inf], [-inf, -inf, -inf, -inf, -inf]], dtype=torch.bfloat16
    )
    valid = torch.tensor([[False, False, True, True, True], [False, True, False, False, True]])
    got = select_topk(scores, valid, 2)
    assert got.tolist() == _oracle(scores, valid, 2) == [[2, 3], [1, 4]]
    assert _select_topk_sorted(scores.double(), valid, 2).tolist() == [[3, -1], [1, -1]]


def test_wide_scores_keep_the_sort():
    gen = torch.Generator().manual_seed(13)
    scores = _tied_scores(19, 200, torch.float32, gen)
    valid = _random_valid(19, 200, 32, gen)
    assert torch.equal(_select_topk(scores, valid, 32), _select_topk_sorted(scores, valid, 32))
    _check(scores.double(), valid, 32)


def test_compiled_region_calls_the_op_with_the_eager_result():
    gen = torch.Generator().manual_seed(14)
    scores = _tied_scores(8, 100, torch.bfloat16, gen)
    valid = _prefix_valid(8, 100, gen)

    def region(s, v):
        return select_topk(s * 1, v, 16) + 0

    compiled = torch.compile(region, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(scores, valid), select_topk(scores, valid, 16))


_BF16_MAX = torch.finfo(torch.bfloat16).max


def _candidate_blocks_widened(
    scores: torch.Tensor, valid: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """`candidate_blocks` as it was: block maxima of the scores widened to the carrier, then the sort."""
    t, n = scores.shape
    nb = -(-n // block_size)
    pad = nb * block_size - n
    s = scores.to(carrier()).masked_fill(~valid, float("-inf"))
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).view(t, nb, block_size)
    block_score = s.max(dim=-1).values.clamp(max=_BF16_MAX)
    klen = valid.sum(dim=1)
    n_blocks = -(-klen // block_size)
    ids = torch.arange(nb, device=scores.device)[None, :]
    newest = ids == (n_blocks - 1)[:, None]
    block_score = torch.where(newest, torch.full_like(block_score, float("inf")), block_score)
    return _select_topk_sorted(block_score, ids < n_blocks[:, None], topk_blocks)


@pytest.mark.parametrize("mode", ["exact", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("n", "block_size", "topk_blocks"), [(200, 4, 6), (130, 8, 3), (64, 16, 8), (9, 4, 1)]
)
def test_candidate_blocks_match_the_widened_version(monkeypatch, mode, dtype, n, block_size, topk_blocks):
    monkeypatch.setenv(numerics.ENV, mode)
    gen = torch.Generator().manual_seed(n * 31 + block_size)
    t = 48
    scores = _tied_scores(t, n, dtype, gen)
    scores[3] = 0.0  # all blocks tie (signed zeros too): lower block ids, then the newest
    scores[4, ::2] = -0.0
    scores[5] = float("inf")  # clamped below the newest block's +inf
    scores[6, : n // 2] = torch.finfo(dtype).max
    valid = _prefix_valid(t, n, gen)
    valid[7], valid[8] = False, True
    valid[9] = torch.arange(n) < 1  # one entry: only the newest block
    got = candidate_blocks(scores, valid, block_size, topk_blocks)
    want = _candidate_blocks_widened(scores, valid, block_size, topk_blocks)
    assert torch.equal(got, want)
    # the newest block (the one holding the last valid entry) is always a candidate
    last = valid.sum(dim=1) - 1
    rows = last >= 0
    assert ((got[rows] == (last[rows] // block_size)[:, None]).any(dim=1)).all()
