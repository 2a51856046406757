"""Batch-invariant attention skips the (row tile, key tile) pairs no row of the row tile sees, for the
products and for the mask / max / exp / sums; this must change no bit against computing every tile
(`sink_attention(..., all_tiles=True)`, the per-tile loop of the full computation). Checked on random
sliding windows, compressed entries and padding at FP64, and on the tiny V4.1 FP32 logits through the
PagedRunner (prefill chunks and decode, sequences of different lengths in one step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.default_model import resolve_model
from deepinfer_model import batch_invariant, load_model
from deepinfer_model.batch_invariant import attention_plan
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner

KT = batch_invariant.KEY_TILE


@pytest.fixture(autouse=True)
def _invariant_mode(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _case(g, bsz, m, nh, d, window, ratio):
    """A group as the paged runtime lays it out: per sequence, window keys in tiles aligned to absolute
    positions, then compressed entries (entry j seen from position p iff j < (p + 1) // ratio), queries
    at consecutive positions; sequences of other lengths padded (padding queries sit on the last
    position, padding keys are never visible)."""
    ends = torch.randint(m // 2 + 1, 4 * m + 40, (bsz,), generator=g)
    qlen = torch.clamp(torch.randint(1, m + 1, (bsz,), generator=g), max=ends)
    starts = ends - qlen
    q_pos = torch.minimum(starts[:, None] + torch.arange(m)[None], ends[:, None] - 1)  # [B, M]
    lo = torch.clamp(starts - window + 1, min=0)
    start = lo - lo % KT
    width = int(batch_invariant.key_tiles(int((ends - start).max())))
    k_pos = start[:, None, None] + torch.arange(width)[None, None]
    vis_w = (k_pos <= q_pos[..., None]) & (k_pos > q_pos[..., None] - window)
    n_e = ends // ratio
    e_width = int(batch_invariant.key_tiles(int(n_e.max())))
    vis_e = torch.arange(e_width)[None, None] < torch.div(q_pos[..., None] + 1, ratio, rounding_mode="floor")
    keys = torch.randn(bsz, width + e_width, d, generator=g, dtype=torch.float64)
    keys[:, width:][torch.arange(e_width)[None] >= n_e[:, None]] = 0.0  # padding entries are zero
    q = torch.randn(bsz, m, nh, d, generator=g, dtype=torch.float64)
    return q, keys, torch.cat((vis_w, vis_e), dim=2)


@pytest.mark.parametrize("dense_fraction", [1.0, -1.0, batch_invariant.DENSE_FRACTION])
def test_tile_skipping_is_bitwise_the_full_tile_computation(dense_fraction, monkeypatch):
    """Forced compact layout (1.0), forced dense layout with skipped products (-1.0), and the default
    choice between them."""
    monkeypatch.setattr(attention_plan, "DENSE_FRACTION", dense_fraction)
    g = torch.Generator().manual_seed(3)
    skipped, paths = 0, set()
    for trial in range(24):
        bsz = int(torch.randint(1, 6, (1,), generator=g))
        m = int(torch.randint(1, 70, (1,), generator=g))
        nh = [1, 3, 4, 8, 16][trial % 5]
        window = int(torch.randint(1, 100, (1,), generator=g))
        ratio = [1, 2, 4][trial % 3]
        q, keys, vis = _case(g, bsz, m, nh, 64, window, ratio)
        sinks = torch.randn(nh, generator=g)
        full = batch_invariant.sink_attention(q, keys, vis, sinks, 0.09, all_tiles=True)
        got = batch_invariant.sink_attention(q, keys, vis, sinks, 0.09)
        plan = batch_invariant.plan_attention(vis, nh)
        paths.add("dense" if plan.dense else "gathered" if plan.by_key is None else "per key tile")
        assert torch.equal(batch_invariant.sink_attention(q, keys, None, sinks, 0.09, plan=plan), full)
        assert torch.equal(got, full), f"trial {trial}: tile skipping changed the FP64 attention output"
        # a real check: some (query, key tile) pairs were not seen and so were skipped
        skipped += int((~vis.view(bsz, m, -1, KT).any(-1)).sum())
    assert skipped > 0
    expected = {1.0: {"gathered", "per key tile"}, -1.0: {"dense"}}.get(dense_fraction, {"dense", "gathered"})
    assert expected <= paths, paths


@pytest.mark.parametrize("dense_fraction", [1.0, -1.0])
def test_plan_of_a_superset_narrowed_to_the_mask_gives_the_same_bits(dense_fraction, monkeypatch):
    """`AttentionPlan.for_visible`: the paged runtime plans the tiles once per step from every entry a
    query may select and narrows the plan to each layer's selection on the device. The extra tiles it
    computes must change no bit against a plan of the exact mask (and against computing every tile)."""
    monkeypatch.setattr(attention_plan, "DENSE_FRACTION", dense_fraction)
    g = torch.Generator().manual_seed(11)
    narrowed_away = 0
    for trial in range(12):
        bsz, m, nh = (
            int(torch.randint(1, 5, (1,), generator=g)),
            int(torch.randint(1, 40, (1,), generator=g)),
            4,
        )
        q, keys, may = _case(
            g, bsz, m, nh, 64, int(torch.randint(1, 60, (1,), generator=g)), [1, 2][trial % 2]
        )
        vis = may & (torch.rand(may.shape, generator=g) < 0.3)  # a selection among the selectable keys
        sinks = torch.randn(nh, generator=g)
        exact = batch_invariant.sink_attention(
            q, keys, vis, sinks, 0.09, plan=batch_invariant.plan_attention(vis, nh)
        )
        narrowed = batch_invariant.plan_attention(may, nh).for_visible(vis)
        got = batch_invariant.sink_attention(q, keys, vis, sinks, 0.09, plan=narrowed)
        assert torch.equal(got, exact), f"trial {trial}: the superset plan changed the FP64 attention output"
        assert torch.equal(got, batch_invariant.sink_attention(q, keys, vis, sinks, 0.09, all_tiles=True))
        # a real check: the superset plan computes tiles the exact mask does not see
        narrowed_away += int((may.view(bsz, m, -1, KT).any(-1) & ~vis.view(bsz, m, -1, KT).any(-1)).sum())
    assert narrowed_away > 0
    with pytest.raises(ValueError, match="for_visible"):
        narrowed.for_visible(vis[:, :1])


def test_gathered_tile_scores_equal_the_per_tile_loop():
    g = torch.Generator().manual_seed(5)
    for bsz, r, tiles in [(1, 1, 1), (3, 13, 3), (8, 2, 5), (2, 70, 2)]:
        q = torch.randn(bsz, r, 128, generator=g, dtype=torch.float64)
        k = torch.randn(bsz, tiles * KT, 128, generator=g, dtype=torch.float64)
        gathered = batch_invariant.tiled_scores(q, k, gather=True)
        assert torch.equal(gathered, batch_invariant.tiled_scores(q, k, gather=False))


def _logits(model, prompts, chunk, decode_steps):
    block = 16
    per_seq = -(-(max(map(len, prompts)) + decode_steps) // block)
    runner = PagedRunner(model, num_blocks=len(prompts) * per_seq, block_size=block)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(len(prompts))]
    done = [0] * len(prompts)
    outs = []
    toks = [list(p) for p in prompts]
    while True:  # prefill in chunks (sequences finish at different steps), then decode together
        plan = [
            (i, min(chunk, len(toks[i]) - done[i])) for i in range(len(prompts)) if done[i] < len(toks[i])
        ]
        if not plan:
            if decode_steps == 0:
                return outs
            decode_steps -= 1
            for i, t in enumerate(toks):
                t.append(int(outs[-1][1][i].argmax()) if len(outs[-1][1]) == len(toks) else 1000 + i)
            continue
        logits = runner.execute(
            StepBatch.of(
                seq_ids=np.array([i for i, _ in plan], dtype=np.int64),
                start_positions=np.array([done[i] for i, _ in plan], dtype=np.int64),
                query_lens=np.array([n for _, n in plan], dtype=np.int64),
                block_tables=[tables[i] for i, _ in plan],
                input_ids=np.array(
                    [t for i, n in plan for t in toks[i][done[i] : done[i] + n]], dtype=np.int64
                ),
                logits_lens=np.array([n for _, n in plan], dtype=np.int64),
            )
        )
        rows = np.cumsum([0] + [n for _, n in plan])
        outs.append((plan, [logits[rows[k + 1] - 1] for k in range(len(plan))], logits.clone()))
        for i, n in plan:
            done[i] += n


def test_tiny_v41_paged_logits_equal_the_full_tile_computation(monkeypatch):
    model = load_model(resolve_model(None)[0], torch.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1000, 90_000, n).tolist() for n in (70, 23, 41)]
    skip = _logits(model, prompts, chunk=32, decode_steps=3)
    every_tile = batch_invariant.sink_attention

    def sink_attention_every_tile(*args, **kwargs):  # whatever the caller asks: every tile product
        return every_tile(*args, **{**kwargs, "all_tiles": True})

    monkeypatch.setattr(batch_invariant, "sink_attention", sink_attention_every_tile)
    full = _logits(model, prompts, chunk=32, decode_steps=3)
    assert len(skip) == len(full) > 4
    for k, (a, b) in enumerate(zip(skip, full)):
        assert a[0] == b[0]
        assert torch.equal(a[2], b[2]), f"step {k} {a[0]}: FP32 logits differ from the full tile computation"
