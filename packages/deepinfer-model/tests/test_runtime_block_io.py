"""Block export / import: a sequence prefilled in one runner's pools, exported (through the flat, checksummed
format), imported into another runner's pools at other block ids, decodes there bit for bit as it does where
the prefill ran: every pool (SWA keys, compressed and C1 entries, compressor inputs of incomplete blocks,
index keys, Engram ids, drafter keys, YOCO slot tags) travels."""

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.models.deepseek_v41.yoco import YocoMode, YocoSettings
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import (
    BlockPayload,
    PagedRunner,
    PayloadError,
    cache_specs,
    export_blocks,
    export_request,
)
from deepinfer_model.runtime.block_io import FORMAT_VERSION, MAGIC

W, B, KEEP = 8, 6, 14  # the tiny model's window, default backtracking, minimal KEEP


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41_block_io"), seed=0))


class Seq:
    """One sequence in one runner: its tokens, block table and the free blocks it grows from."""

    def __init__(self, runner, free, tokens, prompt_len):
        self.runner, self.free, self.tokens, self.prompt_len = runner, list(free), list(tokens), prompt_len
        self.table: list[int] = []
        self.n = 0  # tokens in the cache

    def feed(self, q: int, logits: int = 1) -> torch.Tensor:
        bs = self.runner.block_size
        while len(self.table) * bs < self.n + q:
            self.table.append(self.free.pop(0))
        batch = StepBatch.of(
            seq_ids=[0],
            start_positions=[self.n],
            query_lens=[q],
            block_tables=[np.asarray(self.table, dtype=np.int32)],
            input_ids=np.asarray(self.tokens[self.n : self.n + q]),
            logits_lens=[logits],
            prompt_lens=[self.prompt_len],
        )
        self.n += q
        return self.runner.execute(batch)


def hand_over(model, src: Seq, runner_b, free_b, per_block: bool) -> Seq:
    """Export `src`'s state, pass it through bytes, import it into `runner_b` at blocks from `free_b`."""
    bs = src.runner.block_size
    payload = export_request(src.runner.cache, src.table, src.n, bs, tokens=src.tokens[: src.n])
    assert payload.num_blocks == -(-src.n // bs) and payload.meta["num_tokens"] == src.n
    payload = BlockPayload.from_bytes(payload.to_bytes())
    dst = Seq(runner_b, free_b, src.tokens, src.prompt_len)
    dst.table = [dst.free.pop(0) for _ in range(payload.num_blocks)]
    dst.n = src.n
    assert dst.table != src.table[: payload.num_blocks]  # new ids
    if per_block:  # one block at a time, last first
        for i in reversed(range(payload.num_blocks)):
            one = BlockPayload.from_bytes(payload.block(i).to_bytes())
            runner_b.import_blocks([dst.table[i]], one)
    else:
        runner_b.import_blocks(dst.table, payload)
    return dst


def decode_both(a: Seq, b: Seq, first: torch.Tensor, steps: int) -> None:
    """Greedy decode on both, the same token fed to each; logits must be equal bit for bit."""
    nxt = int(first.argmax())
    for _ in range(steps):
        a.tokens.append(nxt)
        b.tokens.append(nxt)
        la, lb = a.feed(1), b.feed(1)
        assert torch.isfinite(la).all()
        assert torch.equal(la, lb), f"position {a.n - 1}: the importing runner's logits differ"
        nxt = int(la.argmax())
    da = a.runner.draft([nxt], num_draft_tokens=3)[0]
    db = b.runner.draft([nxt], num_draft_tokens=3)[0]
    assert torch.equal(da.tokens, db.tokens) and torch.equal(da.logits, db.logits)


@pytest.mark.parametrize(
    ("block_size", "prompt_len", "chunks", "per_block"),
    [
        (8, 21, [5, 16], False),  # a partial last block; ratio-2 entry incomplete (odd length)
        (4, 19, [19], True),  # per-block payloads, imported in reverse order
        (1, 13, [6, 7], False),  # ratio 2 spans two blocks: the pending entry's input sits in its own block
        (2, 16, [16], True),  # every block full
    ],
)
def test_decode_after_import_equals_decode_where_prefilled(model, block_size, prompt_len, chunks, per_block):
    rng = np.random.default_rng(block_size * 100 + prompt_len)
    tokens = rng.integers(4, model.config.vocab_size, prompt_len).tolist()
    runner_a = PagedRunner(model, num_blocks=48, block_size=block_size)
    runner_b = PagedRunner(model, num_blocks=37, block_size=block_size)
    a = Seq(runner_a, rng.permutation(48).tolist(), tokens, prompt_len)
    for q in chunks:
        logits = a.feed(q)
    b = hand_over(model, a, runner_b, rng.permutation(37).tolist(), per_block)
    decode_both(a, b, logits[-1], steps=2 * block_size + 3)


@pytest.mark.parametrize("mode", ["mask", "compact"])
def test_yoco_truncated_prefill_survives_the_hand_over(model, mode):
    """The slot tags (which rect_lo wrote each consumer key) travel too: decode on the importing runner,
    keyed by the same original prompt length, equals decode where the truncated prefill ran."""
    rng = np.random.default_rng(7)
    prompt_len, bs = 33, 4
    tokens = rng.integers(4, model.config.vocab_size, prompt_len).tolist()
    yoco = YocoSettings(YocoMode(mode), KEEP)
    runner_a = PagedRunner(model, 40, bs, yoco=yoco, backtracking=B)
    runner_b = PagedRunner(model, 30, bs, yoco=yoco, backtracking=B)
    a = Seq(runner_a, rng.permutation(40).tolist(), tokens, prompt_len)
    a.feed(20, logits=0)
    logits = a.feed(13)
    b = hand_over(model, a, runner_b, rng.permutation(30).tolist(), per_block=False)
    decode_both(a, b, logits[-1], steps=9)
    # the importing runner refuses to resume these keys under another prompt length, as the source does
    problem_a = runner_a.yoco_resume_problem(a.table, 0, 1, prompt_len - 5)
    problem_b = runner_b.yoco_resume_problem(b.table, 0, 1, prompt_len - 5)
    assert (problem_a is None) == (problem_b is None)


def test_payload_format_is_versioned_and_checksummed(model, tmp_path):
    runner = PagedRunner(model, 8, 4)
    s = Seq(runner, range(8), list(range(4, 14)), 10)
    s.feed(10)
    payload = runner.export_blocks(s.table, meta={"note": "x"})
    data = payload.to_bytes()
    assert data[:8] == MAGIC
    path = tmp_path / "blocks.kv"
    assert payload.save(path) == len(data)
    back = BlockPayload.load(path)
    assert back.meta == {"note": "x"} and back.block_size == 4
    for name, t in payload.pools.items():
        assert torch.equal(back.pools[name].nan_to_num(7.0), t.nan_to_num(7.0))
    assert back.nbytes == len(s.table) * sum(sp.bytes_per_block() for sp in cache_specs(model, 4))
    corrupt = bytearray(data)
    corrupt[-3] ^= 0xFF  # inside the last pool's buffer
    last = list(payload.pools)[-1]
    with pytest.raises(PayloadError, match=f"pool {last} checksum mismatch"):
        BlockPayload.from_bytes(bytes(corrupt))
    bad_version = bytearray(data)
    bad_version[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
    with pytest.raises(
        PayloadError, match=f"format version must be {FORMAT_VERSION}, got {FORMAT_VERSION + 1}"
    ):
        BlockPayload.from_bytes(bytes(bad_version))
    with pytest.raises(PayloadError, match="header checksum mismatch"):
        BlockPayload.from_bytes(data[:30] + bytes([data[30] ^ 1]) + data[31:])
    with pytest.raises(PayloadError, match="not a DeepInfer block payload"):
        BlockPayload.from_bytes(b"x" * 64)
    with pytest.raises(PayloadError, match="truncated"):
        BlockPayload.from_bytes(data[:-10])


def test_import_refuses_what_does_not_fit(model):
    plain = PagedRunner(model, 8, 4)
    yoco = PagedRunner(model, 8, 4, yoco=YocoSettings(YocoMode.MASK, KEEP), backtracking=B)
    payload = export_blocks(yoco.cache, [0, 1], 4)
    with pytest.raises(PayloadError, match=r"unexpected \['yoco_tag'\]|unexpected \[.*yoco"):
        plain.import_blocks([2, 3], payload)
    with pytest.raises(ValueError, match=r"one block per payload block \(2\), got 1"):
        yoco.import_blocks([2], payload)
    with pytest.raises(ValueError, match=r"block_ids must be in \[0, 8\)"):
        yoco.import_blocks([2, 8], payload)
    with pytest.raises(PayloadError, match="payload block_size 4 != the cache's 8"):
        PagedRunner(model, 8, 8, yoco=YocoSettings(YocoMode.MASK, KEEP), backtracking=B).import_blocks(
            [0, 1], payload
        )
    with pytest.raises(ValueError, match="3 tokens need 1"):
        export_request(plain.cache, [], 3, 4)
