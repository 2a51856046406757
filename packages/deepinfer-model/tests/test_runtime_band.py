"""Sliding-window attention over the window band only (`models.grouped_attention.attend`, default path).

The band path scores, for a block of b query slots, only the b + W - 1 key columns those queries can
see, instead of every key of the chunk. The previous implementation scored every key of the span
[start - W + 1, end) and masked all but the window; its computation is kept below (`_old_attend`, FP64)
as the reference: invisible keys had exactly zero probability there, so the two differ at most in FP64
summation order, and must agree bitwise once rounded to FP32 (the model's storage rounding).
"""

import numpy as np
import pytest
import torch
from deepinfer_model import batch_invariant
from deepinfer_model.layers.indexer import select_topk, selection_mask
from deepinfer_model.models import grouped_attention as groups
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.models.grouped_attention import sizes
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.runtime.metadata import StepMetadata
from deepinfer_model.runtime.pools import PagedKVCache, PoolSpec
from torch.overrides import TorchFunctionMode

BLOCK = 16
NH, D = 4, 32


def _old_attend(q, pool, meta, g, window, floor, entries, entry_vis, sinks, scale):
    """The previous computation: every key of lo .. hi - 1 (lo = max(start - W + 1, 0)) scored, then masked
    to each query's window (and floor), in FP64; returns [real query slots, nh, D]."""
    seqs = g.seqs
    lo = np.maximum(meta.starts[seqs] - window + 1, 0)
    hi = meta.ends[seqs]
    width = int((hi - lo).max())
    pos = np.clip(lo[:, None] + np.arange(width)[None, :], lo[:, None], hi[:, None] - 1)
    keys = pool[torch.as_tensor(meta.token_slots_of(seqs[:, None], pos))].double()
    k_pos = torch.as_tensor(lo[:, None] + np.arange(width)[None, :])[:, None, :]
    q_pos = g.q_pos[:, :, None]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window)
    if floor is not None:
        f = torch.as_tensor(floor)[:, None, None]
        visible = visible & (k_pos >= f)
        keys = keys.masked_fill(torch.as_tensor(pos < floor[:, None])[..., None], 0.0)
    visible = visible.reshape(-1, width)
    if entries is not None:
        keys = torch.cat((keys, entries.double()), dim=1)
        visible = torch.cat((visible, entry_vis), dim=1)
    gq = g.rows.shape
    qs = q[g.rows].double()
    scores = torch.einsum("gqhd,gsd->gqhs", qs, keys) * scale
    scores = scores.masked_fill(~visible.view(*gq, 1, -1), float("-inf"))
    sink = sinks.double()[None, None, :, None].expand(*gq, -1, 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    out = torch.einsum("gqhs,gsd->gqhd", probs, keys)
    return out[g.qmask]


def _step(starts, qlens, tables):
    n = int(np.sum(qlens))
    batch = StepBatch.of(
        seq_ids=np.arange(len(starts), dtype=np.int64),
        start_positions=np.asarray(starts, dtype=np.int64),
        query_lens=np.asarray(qlens, dtype=np.int64),
        block_tables=tables,
        input_ids=np.zeros(n, dtype=np.int64),
        logits_lens=np.ones(len(starts), dtype=np.int64),
    )
    return StepMetadata.build(batch, BLOCK, num_blocks=sum(len(t) for t in tables))


class _ScoreWidths(TorchFunctionMode):
    """Records the key width of every attention score tensor (window band and entries)."""

    def __init__(self):
        super().__init__()
        self.widths = []
        self.entry_widths = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.einsum and args[0] == "gqhd,gsd->gqhs":
            self.widths.append(out.shape[-1])
        if func is torch.einsum and args[0] in ("gqhd,gnd->gqhn", "gqhd,gqkd->gqhk"):
            self.entry_widths.append(out.shape[-1])
        return out


@pytest.mark.parametrize("window", [1, 8, 37])
@pytest.mark.parametrize("with_floor", [False, True])
@pytest.mark.parametrize("with_entries", [None, "mask", "selection"])
def test_band_attention_matches_the_full_span_computation(window, with_floor, with_entries):
    """A 300-token chunk after 20 cached tokens, a 290-token chunk from 0 (padded in the same group) and a
    260-token chunk after 100: every real query's output against the old full-span computation."""
    rng = np.random.default_rng(window)
    starts, qlens = [20, 0, 100], [300, 290, 260]
    per_seq = -(-(max(s + q for s, q in zip(starts, qlens))) // BLOCK)
    perm = rng.permutation(3 * per_seq)  # scattered physical blocks
    tables = [perm[i * per_seq : (i + 1) * per_seq].astype(np.int32) for i in range(3)]
    meta = _step(starts, qlens, tables)
    (g,) = groups.make_groups(meta)  # all three share the 257..512 bucket
    assert g.real_slots is not None  # padding slots are present (290 and 260 < 300)
    cache = PagedKVCache([PoolSpec("swa.0", BLOCK, D)], 3 * per_seq)
    pool = torch.randn(
        3 * per_seq * BLOCK, D, dtype=torch.float32, generator=torch.Generator().manual_seed(1)
    )
    cache.write("swa.0", torch.arange(pool.shape[0]), pool)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(int(meta.offsets[-1]), NH, D, generator=gen)
    sinks = torch.randn(NH, generator=gen)
    floor = np.array([150, 0, 120], dtype=np.int64) if with_floor else None
    entries = entry_vis = extra = None
    if with_entries:  # e.g. compressed entries: shared per sequence, a random visible subset per query
        entries = torch.randn(3, 40, D, generator=gen)
        entry_vis = torch.rand(3 * g.rows.shape[1], 40, generator=gen) < 0.3
        extra = (entries, entry_vis)
    if with_entries == "selection":  # a top-k selection (ascending, -1 padded) and its mask
        selected = select_topk(torch.randn(entry_vis.shape, generator=gen), entry_vis, 16)
        assert (selected < 0).any() and (selected >= 0).any()
        entry_vis = selection_mask(selected, 40)
        extra = (entries, selected)
    scale = D**-0.5
    wk = groups.swa_keys(cache, meta, g, "swa.0", window, floor)
    widths = _ScoreWidths()
    with widths:
        new = groups.attend(q, wk, g, sinks, scale, meta, extra)
    ref = _old_attend(q, pool, meta, g, window, floor, entries, entry_vis, sinks, scale)
    assert new.dtype == torch.float64 and new.shape == ref.shape == (sum(qlens), NH, D)
    assert torch.isfinite(new).all()
    torch.testing.assert_close(new, ref, rtol=1e-12, atol=1e-13)
    assert torch.equal(new.float(), ref.float())  # the storage rounding sees the same values
    # the band: every score tensor spans at most one block plus the window (not the 300 + W - 1 columns);
    # a selection scores its k entries per query, not all 40
    if with_entries == "selection":
        assert max(widths.entry_widths) == 16
    block = max(sizes.BAND_BLOCK_ROWS, 2 * window)
    assert widths.widths and max(widths.widths) <= block + window - 1 < 300 + window - 1


def test_band_attention_at_decode_scores_only_the_window():
    """Decode rows (one query each, long contexts): W columns per sequence, same outputs as before."""
    starts, qlens, window = [200, 37, 5], [1, 1, 1], 8
    tables = [np.arange(i * 16, (i + 1) * 16, dtype=np.int32) for i in range(3)]
    meta = _step(starts, qlens, tables)
    (g,) = groups.make_groups(meta)
    assert g.real_slots is None  # no padding: no index gather of the output
    cache = PagedKVCache([PoolSpec("swa.0", BLOCK, D)], 48)
    pool = torch.randn(48 * BLOCK, D, generator=torch.Generator().manual_seed(3))
    cache.write("swa.0", torch.arange(pool.shape[0]), pool)
    gen = torch.Generator().manual_seed(4)
    q, sinks = torch.randn(3, NH, D, generator=gen), torch.randn(NH, generator=gen)
    wk = groups.swa_keys(cache, meta, g, "swa.0", window)
    assert wk.keys.shape == (3, window, D)
    new = groups.attend(q, wk, g, sinks, D**-0.5, meta)
    ref = _old_attend(q, pool, meta, g, window, None, None, None, sinks, D**-0.5)
    torch.testing.assert_close(new, ref, rtol=1e-12, atol=1e-13)
    assert torch.equal(new.float(), ref.float())


def test_swa_keys_rejects_a_window_below_one():
    meta = _step([0], [3], [np.arange(1, dtype=np.int32)])
    (g,) = groups.make_groups(meta)
    cache = PagedKVCache([PoolSpec("swa.0", BLOCK, D)], 1)
    with pytest.raises(ValueError, match="sliding window = 0 must be >= 1"):
        groups.swa_keys(cache, meta, g, "swa.0", 0)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41"), seed=5))


def test_long_prefill_chunk_is_bitwise_the_stateless_forward(v41):
    """Tiny V4.1 (window 8): one 240-token chunk, then 2 decode steps, against the stateless forward."""
    assert not batch_invariant.enabled()
    ids = np.random.default_rng(7).integers(4, v41.config.vocab_size, 242)
    runner = PagedRunner(v41, num_blocks=16, block_size=BLOCK)
    table = [np.random.default_rng(8).permutation(16).astype(np.int32)]
    rows = []
    for start, q in ((0, 240), (240, 1), (241, 1)):
        batch = StepBatch.of(
            seq_ids=np.zeros(1, dtype=np.int64),
            start_positions=np.array([start], dtype=np.int64),
            query_lens=np.array([q], dtype=np.int64),
            block_tables=table,
            input_ids=ids[start : start + q].astype(np.int64),
            logits_lens=np.array([q], dtype=np.int64),
        )
        rows.append(runner.execute(batch))
    paged = torch.cat(rows)
    ref = v41.forward(torch.as_tensor(ids))
    ref = ref.logits if hasattr(ref, "logits") else ref
    assert torch.isfinite(paged).all()
    assert torch.equal(paged, ref.to(paged.dtype))
