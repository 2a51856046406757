"""Behavioural properties of the stateless V4 model and its blocks that a user (and the cache runtime) relies on."""

from __future__ import annotations

import pytest
import torch
from deepinfer_model import load_model
from deepinfer_model.layers import (
    compressed_visible,
    route_hash,
    route_topk,
    select_topk,
    sliding_window_visible,
)
from deepinfer_model.testing import make_checkpoint, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

GEN = torch.Generator().manual_seed(0)


def _one_layer(tmp_path, name, kind, window, **over):
    cfg = tiny_config(
        num_hidden_layers=1,
        layer_types=[kind],
        mlp_layer_types=["moe"],
        sliding_window=window,
        **over,
    )
    return load_model(make_checkpoint(tmp_path / name, cfg, seed=5, tokenizer=False))


@pytest.fixture(scope="module")
def full_model(tmp_path_factory):
    return load_model(
        make_checkpoint(tmp_path_factory.mktemp("full"), tiny_config(), seed=1, tokenizer=False)
    )


def test_causality(full_model):
    ids = torch.randint(0, 128, (36,), generator=GEN)
    base = full_model.forward(ids)
    for cut in (1, 9, 20, 35):
        changed = ids.clone()
        changed[cut:] = torch.randint(0, 128, (36 - cut,), generator=GEN)
        changed[cut] = (ids[cut] + 1) % 128
        out = full_model.forward(changed)
        assert torch.equal(out[:cut], base[:cut]), f"logits before {cut} moved when later tokens changed"
        assert not torch.allclose(out[cut], base[cut])


def test_prefix_forward_equals_full_forward_rows(full_model):
    """What a decode step must reproduce: the forward over the prefix 0..p gives row p of the full forward,
    bitwise (FP64 accumulation makes rows independent of the number of rows computed together)."""
    ids = torch.randint(0, 128, (30,), generator=GEN)
    full = full_model.forward(ids)
    for p in (0, 3, 4, 11, 29):
        assert torch.equal(full_model.forward(ids[: p + 1])[-1], full[p])


def test_sliding_window_locality(tmp_path):
    window = 4
    model = _one_layer(tmp_path, "swa", "sliding_attention", window)
    ids = torch.randint(0, 128, (16,), generator=GEN)
    base = model.forward(ids)
    s = 5
    changed = ids.clone()
    changed[s] = (ids[s] + 7) % 128
    out = model.forward(changed)
    seen = torch.tensor([not torch.equal(out[t], base[t]) for t in range(16)])
    expected = torch.tensor([s <= t < s + window for t in range(16)])  # keys (t-W, t]
    assert torch.equal(seen, expected)


@pytest.mark.parametrize(
    "kind,ratio", [("heavily_compressed_attention", 4), ("compressed_sparse_attention", 4)]
)
def test_compressed_entry_visible_only_once_block_complete(tmp_path, kind, ratio):
    # window 1: a query sees only itself through the window, so any earlier influence is a compressed entry
    rates = {"compressed_sparse_attention": ratio, "heavily_compressed_attention": ratio}
    model = _one_layer(tmp_path, kind, kind, 1, compress_rates=rates, index_topk=64)
    ids = torch.randint(0, 128, (16,), generator=GEN)
    base = model.forward(ids)
    s = 5  # in block 1 = tokens 4..7, complete at position 7
    changed = ids.clone()
    changed[s] = (ids[s] + 3) % 128
    out = model.forward(changed)
    moved = [t for t in range(16) if not torch.equal(out[t], base[t])]
    # CSA blocks overlap: entry j also pools the previous block, so token 5 reaches entries 1 and 2
    assert moved[0] == s and moved[1:] == list(range(2 * ratio - 1, 16)), moved


def test_visibility_rules():
    pos = torch.arange(10)
    vis = sliding_window_visible(pos, pos, 3)
    assert vis.sum(1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    assert not vis.triu(1).any()
    comp = compressed_visible(pos, 3, 3)
    # entry j covers tokens 3j..3j+2 and appears at position 3j+2
    assert comp.sum(1).tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]


def test_routing_weights_sum_to_scaling_and_bias_only_selects():
    logits = torch.randn(50, 16, generator=GEN)
    bias = torch.randn(16, generator=GEN)
    w, ids = route_topk(logits, bias, 4, 2.5)
    assert torch.allclose(w.sum(-1), torch.full((50,), 2.5), atol=1e-5)
    assert ids.unique(dim=1).shape[1] == 4 if ids.shape[0] else True
    w0, ids0 = route_topk(logits, None, 4, 2.5)
    assert not torch.equal(ids, ids0)  # the bias changes which experts are picked ...
    scores = torch.nn.functional.softplus(logits).sqrt()
    expect = scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True) * 2.5
    assert torch.allclose(w, expect, atol=1e-6)  # ... but the weights use unbiased scores
    table = torch.stack([torch.randperm(16, generator=GEN)[:4] for _ in range(8)])
    tokens = torch.randint(0, 8, (50,), generator=GEN)
    hw, hids = route_hash(logits, tokens, table, 1.5)
    assert torch.equal(hids, table[tokens]) and torch.allclose(hw.sum(-1), torch.full((50,), 1.5), atol=1e-5)


def test_router_ties_pick_lower_expert_id():
    logits = torch.zeros(1, 6)
    _, ids = route_topk(logits, torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 3, 1.0)
    assert ids[0].tolist() == [1, 3, 0]


def test_topk_selection_ties_order_and_padding():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0], [2.0, 1.0, 0.0, 0.0, 0.0]])
    valid = torch.tensor([[True] * 5, [True] * 5, [True, True, False, False, False]])
    sel = select_topk(scores, valid, 3)
    assert sel.tolist() == [[1, 2, 4], [0, 1, 2], [0, 1, -1]]
    assert select_topk(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), 2).tolist() == [[-1, -1]] * 2


def test_token_ids_out_of_range_raise(full_model):
    with pytest.raises(ValueError, match="vocab_size"):
        full_model.forward([1, 2, 128])
    with pytest.raises(ValueError, match="1-D"):
        full_model.forward(torch.zeros(2, 2, dtype=torch.long))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=1, max_size=12),
        min_size=1,
        max_size=4,
    ),
    k=st.integers(1, 6),
)
def test_topk_selection_equals_python_sort_with_many_ties(rows, k):
    n = max(len(r) for r in rows)
    scores = torch.zeros(len(rows), n)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        for j, (s, v) in enumerate(r):
            scores[i, j], valid[i, j] = float(s), v
    got = select_topk(scores, valid, k)
    for i in range(len(rows)):
        cand = sorted((-scores[i, j].item(), j) for j in range(n) if valid[i, j])
        want = sorted(j for _, j in cand[:k])
        assert got[i].tolist() == want + [-1] * (k - len(want))
