"""Graph-safe greedy drafts (`runtime.draft_graphs`) on the CPU: the static draft step equals the eager
batched draft (`v41_paged_draft`, greedy) bit for bit on every real row, through padded sequence
buckets, contexts shorter and longer than the sliding window, FP32 and BF16 + quantised KV, and
batch-invariant mode; it makes no host sync; `PagedRunner.draft` takes it only for eligible drafts.
Sampled drafts (`runtime.draft_sampling`): the static draft's tokens, confidences and q equal, bit for
bit, the eager draft's with a per-row reference sampler written from the definitions, for mixed
greedy / sampled rows, temperatures, top-p / top-k / min-p, padded buckets and batch-invariant mode.

The oracle is the eager batched draft, which test_draft_batched.py checks against an independent
per-sequence drafter; the CUDA graph replays are tested in test_draft_graphs_gpu.py (marked gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
from deepinfer_model.models.deepseek_v41.drafter import greedy
from deepinfer_model.models.deepseek_v41.paged import draft_last_positions, draft_window_slots
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import DraftSampling, PagedRunner
from deepinfer_model.runtime.cuda_graphs import DecodeGraphSettings
from deepinfer_model.sampling import RowParams
from deepinfer_model.testing.draft_reference import PerRowDraftReference
from deepinfer_model.testing.no_sync import HostSyncError, no_host_sync

BLOCK, MAX_CTX, K = 4, 64, 3
# contexts around the tiny config's sliding window (8): shorter, equal, longer
LENGTHS = (3, 21, 8, 14, 5)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41draftgraphs"), seed=5))


@pytest.fixture(scope="module")
def bf16_kvq(fp32):
    return DeepseekV41ForCausalLM(
        fp32.config, fp32.weights, fp32.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
    )


def _settings(k=K, max_seqs=8):
    return DecodeGraphSettings(max_seqs * (1 + k), MAX_CTX, 4, capture=False, max_query_len=1 + k)


def _prefilled(model, settings=None, lengths=LENGTHS, seed=0):
    """A runner with decode graphs (uncaptured) after one eager prefill step of every sequence, its
    blocks shuffled (a window's slots span blocks in no order)."""
    rng = np.random.default_rng(seed)
    need = [-(-n // BLOCK) for n in lengths]
    perm = rng.permutation(sum(need))
    tables = np.split(perm.astype(np.int32), np.cumsum(need)[:-1])
    runner = PagedRunner(model, num_blocks=sum(need), block_size=BLOCK, decode_graphs=settings or _settings())
    runner.execute(
        StepBatch.of(
            seq_ids=np.arange(len(lengths)),
            start_positions=np.zeros(len(lengths), dtype=np.int64),
            query_lens=np.asarray(lengths),
            block_tables=list(tables),
            input_ids=rng.integers(4, 256, sum(lengths)),
            logits_lens=np.ones(len(lengths), dtype=np.int64),
        )
    )
    return runner


CASES = (  # (sequences, last positions or None = each one's last), 1 / 3 / 5 sequences
    ([1], None),
    ([4, 0, 2], None),
    ([0, 1, 2, 3, 4], [2, 16, 7, 13, 1]),
    ([3, 1, 0, 2, 4], None),
)


def _static(runner, seqs, tokens, lasts):
    """The static draft of bucket select(n) on the runner's buffers (no graph): all five outputs."""
    g = runner.draft_graphs
    meta = runner._last_meta
    seq_arr = np.asarray(seqs, dtype=np.int64)
    last = draft_last_positions(runner.model, meta, seq_arr, tokens, lasts)
    b = g.select(len(seqs))
    slots = draft_window_slots(meta, seq_arr, last, g.window, g.window)
    g._fill(b, np.asarray(tokens), last, slots)
    return b, g._static(b)


def _check_equal(runner, seqs, lasts, seed):
    tokens = [int(t) for t in np.random.default_rng(seed).integers(4, 256, len(seqs))]
    eager = runner.draft(tokens, K, seq_indices=seqs, last_positions=lasts)
    b, (tok, logits, conf, hidden, pos) = _static(runner, seqs, tokens, lasts)
    assert b >= len(seqs) and tok.shape == (b, K)
    for j, d in enumerate(eager):
        assert torch.equal(tok[j], d.tokens), (seqs, j)
        assert torch.equal(logits[j], d.logits), (seqs, j)
        assert torch.equal(conf[j], d.confidence), (seqs, j)
        assert torch.equal(hidden[j], d.hidden), (seqs, j)
        assert torch.equal(pos[j], d.positions), (seqs, j)
    return b


@pytest.mark.parametrize("numerics", ["fp32", "bf16_kvq"])
def test_static_draft_equals_eager_batched_draft(numerics, request):
    runner = _prefilled(request.getfixturevalue(numerics))
    assert runner.draft_graphs.buckets == [1, 2, 4, 8]
    buckets = {_check_equal(runner, seqs, lasts, i) for i, (seqs, lasts) in enumerate(CASES)}
    assert buckets == {1, 4, 8}  # 3 and 5 sequences: padded buckets


@pytest.mark.parametrize("numerics", ["fp32", "bf16_kvq"])
def test_static_draft_equals_eager_batch_invariant(numerics, request, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    runner = _prefilled(request.getfixturevalue(numerics))
    assert runner.draft_graphs.problem(3, K) is None  # the CPU static draft is allowed in this mode
    for i, (seqs, lasts) in enumerate(CASES[1:]):
        _check_equal(runner, seqs, lasts, 10 + i)


def test_static_draft_makes_no_host_sync(bf16_kvq, monkeypatch):
    runner = _prefilled(bf16_kvq)
    seqs, lasts = CASES[2]
    tokens = [5, 6, 7, 8, 9]
    meta, g = runner._last_meta, runner.draft_graphs
    last = draft_last_positions(runner.model, meta, np.asarray(seqs), tokens, lasts)
    g._fill(8, np.asarray(tokens), last, draft_window_slots(meta, np.asarray(seqs), last, g.window, g.window))
    with no_host_sync():
        g._static(8)
    with pytest.raises(HostSyncError):  # the eager draft builds its inputs on the host: not vacuous
        with no_host_sync():
            runner.draft(tokens, K, seq_indices=seqs, last_positions=lasts)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    with no_host_sync():
        g._static(8)


def test_runner_takes_the_static_path_for_greedy_drafts(fp32):
    runner = _prefilled(fp32)
    g = runner.draft_graphs
    for i, (seqs, lasts) in enumerate(CASES):
        tokens = [int(t) for t in np.random.default_rng(i).integers(4, 256, len(seqs))]
        eager = runner.draft(tokens, K, seq_indices=seqs, last_positions=lasts)
        for sampler in (None, greedy, [greedy] * len(seqs)):
            before = g.replays
            static = runner.draft(
                tokens, K, seq_indices=seqs, sampler=sampler, last_positions=lasts, tokens_only=True
            )
            assert g.replays == before + 1
            for a, b in zip(eager, static):
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.confidence, b.confidence)
                assert torch.equal(a.positions, b.positions)
                assert b.logits is None and b.hidden is None
    # the static path validates like the eager one
    with pytest.raises(ValueError, match="last_positions"):
        runner.draft([5], K, seq_indices=[0], last_positions=[3], tokens_only=True)
    with pytest.raises(ValueError, match="next_token"):
        runner.draft([10**6], K, seq_indices=[0], tokens_only=True)


class _Keyed:
    def __init__(self, seed):
        self.seed = seed

    def __call__(self, logits, step):
        u = torch.rand(
            (), generator=torch.Generator().manual_seed(100 * self.seed + step), dtype=torch.float64
        )
        q = torch.softmax(logits.double() / 0.8, dim=-1)
        return torch.searchsorted(torch.cumsum(q, 0), u.reshape(1), right=True)[0].clamp(max=q.numel() - 1)


def test_ineligible_drafts_run_eagerly(fp32, monkeypatch):
    runner = _prefilled(fp32)
    g = runner.draft_graphs
    seqs = [0, 1, 2]
    for kwargs in (
        dict(sampler=[_Keyed(k) for k in seqs], tokens_only=True),  # sampled drafts
        dict(sampler=[greedy, _Keyed(1), greedy], tokens_only=True),  # one sampled request
        dict(tokens_only=False),  # the caller wants logits / hidden
    ):
        d = runner.draft([5, 6, 7], K, seq_indices=seqs, **kwargs)
        assert g.replays == 0 and d[0].logits is not None
    for k in (1, K + 1):  # another draft count than the graphs'
        d = runner.draft([5, 6, 7], k, seq_indices=seqs, tokens_only=True)
        assert g.replays == 0 and d[0].tokens.shape == (k,) and d[0].logits is not None
    assert "draft count" in g.problem(3, K + 1) and "sequences" in g.problem(9, K)
    # batch-invariant mode with batch-invariant graphs turned off: refused
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    g.settings = DecodeGraphSettings(
        8 * (1 + K), MAX_CTX, 4, capture=True, max_query_len=1 + K, batch_invariant=False
    )
    assert "batch-invariant" in g.problem(3, K)
    # no draft graphs without drafting (nextn 0) or without decode graphs
    assert _prefilled(fp32, DecodeGraphSettings(8, MAX_CTX, 4, capture=False)).draft_graphs is None
    assert PagedRunner(fp32, num_blocks=4, block_size=BLOCK).draft_graphs is None
    # draft graphs are on by default (`draft`, the engine's DEEPINFER_CUDAGRAPH_DRAFT); draft=False keeps
    # drafts eager, with or without capture
    plain = PagedRunner(fp32, num_blocks=4, block_size=BLOCK)
    for capture in (True, False):
        plain._make_draft_graphs(
            DecodeGraphSettings(8 * (1 + K), MAX_CTX, 4, capture=capture, max_query_len=1 + K, draft=False)
        )
        assert plain.draft_graphs is None
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):  # the default: built (CUDA only)
        plain._make_draft_graphs(DecodeGraphSettings(8 * (1 + K), MAX_CTX, 4, max_query_len=1 + K))


# -- sampled drafts ------------------------------------------------------------------------------------


SAMPLED_CASES = (  # (sequences, last positions, per-row params): padded buckets 4 and 8, 1 and 3 rows
    (
        [4, 0, 2],
        None,
        [
            RowParams(temperature=0.0, top_p=0.5),  # a greedy row's filters are not read
            RowParams(temperature=0.8, top_p=0.9, seed=3),
            RowParams(temperature=1.3, top_k=5, seed=2**64 - 3),
        ],
    ),
    (
        [0, 1, 2, 3, 4],
        [2, 16, 7, 13, 1],
        [
            RowParams(temperature=0.6, min_p=0.1, seed=1),
            RowParams(temperature=0.0),
            RowParams(temperature=1.0, seed=7),
            RowParams(temperature=0.3, top_p=0.5, top_k=20, min_p=0.05, seed=123456789),
            RowParams(temperature=0.0),
        ],
    ),
    ([1], None, [RowParams(temperature=2.0, seed=11)]),  # no sort pass
    (  # every row sampled (q handed out without a gather), tiny and large temperatures
        [3, 1, 0],
        [9, 20, 2],
        [RowParams(temperature=0.05, seed=5), RowParams(temperature=5.0, seed=6), RowParams(temperature=0.9)],
    ),
)


def _sampled_check(runner, case, seed):
    seqs, lasts, params = case
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(4, 256, len(seqs))]
    seeds = [int(s) + 1000 * seed for s in rng.integers(0, 2**62, len(seqs))]
    positions = [int(p) for p in rng.integers(0, 500, len(seqs))]
    g = runner.draft_graphs
    eager_ref = PerRowDraftReference(params, seeds, positions)
    eager = runner.draft(tokens, K, seq_indices=seqs, sampler=eager_ref, last_positions=lasts)
    static_ref = PerRowDraftReference(params, seeds, positions)
    before = (g.replays, g.sampled_replays)
    static = runner.draft(
        tokens, K, seq_indices=seqs, sampler=static_ref, last_positions=lasts, tokens_only=True
    )
    assert (g.replays, g.sampled_replays) == (before[0] + 1, before[1] + 1)
    assert all(not q for q in static_ref.q)  # the graph drew in the sampler's place
    for j, (e, s) in enumerate(zip(eager, static)):
        assert torch.equal(e.tokens, s.tokens), (seqs, j, e.tokens, s.tokens)
        assert torch.equal(e.confidence, s.confidence), (seqs, j)
        assert torch.equal(e.positions, s.positions), (seqs, j)
        assert s.logits is None and s.hidden is None
        if params[j].greedy:
            assert s.probs is None
        else:
            assert s.probs.dtype == torch.float64 and s.probs.shape == (K, runner.vocab_size)
            assert torch.equal(s.probs, torch.stack(eager_ref.q[j])), (seqs, j)
    return g.select(len(seqs))


@pytest.mark.parametrize("numerics", ["fp32", "bf16_kvq"])
def test_static_sampled_draft_equals_eager_sampled_draft(numerics, request):
    runner = _prefilled(request.getfixturevalue(numerics))
    buckets = {_sampled_check(runner, case, i) for i, case in enumerate(SAMPLED_CASES)}
    assert buckets == {1, 4, 8}
    # the drafts differ from greedy ones (the sampled path is not the argmax in disguise)
    seqs, lasts, _ = SAMPLED_CASES[3]
    hot = PerRowDraftReference([RowParams(temperature=5.0, seed=s) for s in range(3)], [1, 2, 3], [0, 0, 0])
    sampled = runner.draft(
        [5, 6, 7], K, seq_indices=seqs, sampler=hot, last_positions=lasts, tokens_only=True
    )
    greedy_drafts = runner.draft([5, 6, 7], K, seq_indices=seqs, last_positions=lasts, tokens_only=True)
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(sampled, greedy_drafts))


def test_static_sampled_draft_equals_eager_batch_invariant(fp32, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    runner = _prefilled(fp32)
    for i, case in enumerate(SAMPLED_CASES[:2]):
        _sampled_check(runner, case, 20 + i)


def test_static_sampled_draft_makes_no_host_sync(bf16_kvq):
    runner = _prefilled(bf16_kvq)
    seqs, lasts, params = SAMPLED_CASES[1]
    tokens = [5, 6, 7, 8, 9]
    meta, g = runner._last_meta, runner.draft_graphs
    last = draft_last_positions(runner.model, meta, np.asarray(seqs), tokens, lasts)
    sampling = PerRowDraftReference(params, range(5), range(5)).static_sampling()
    g._sampling_buffers()
    slots = draft_window_slots(meta, np.asarray(seqs), last, g.window, g.window)
    g._fill(8, np.asarray(tokens), last, slots, sampling)
    for sort in (False, True):
        with no_host_sync():
            g._static(8, sort)


def test_sampled_drafts_that_cannot_replay_run_eagerly(fp32):
    runner = _prefilled(fp32)
    g = runner.draft_graphs
    seqs, lasts, params = SAMPLED_CASES[0]
    ref = PerRowDraftReference(params, [1, 2, 3], [4, 5, 6], describe=False)  # no graph-safe description
    d = runner.draft([5, 6, 7], K, seq_indices=seqs, sampler=ref, last_positions=lasts, tokens_only=True)
    assert g.replays == 0 and d[0].logits is not None and ref.q[1]
    ref = PerRowDraftReference(params, [1, 2, 3], [4, 5, 6])
    d = runner.draft([5, 6, 7], K, seq_indices=seqs, sampler=ref, last_positions=lasts)  # wants logits
    assert g.replays == 0 and d[0].logits is not None and d[0].probs is None
    with pytest.raises(ValueError, match="logits processors"):
        DraftSampling(
            (RowParams(temperature=1.0, presence_penalty=0.5),), np.zeros(1, np.int64), np.zeros(1, np.int64)
        )
    with pytest.raises(ValueError, match="one entry per row"):
        DraftSampling((RowParams(),), np.zeros(2, np.int64), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="rows for"):
        one_row = DraftSampling((RowParams(),), np.zeros(1, np.int64), np.zeros(1, np.int64))
        g.run(runner._last_meta, np.asarray(seqs), [5, 6, 7], np.asarray([1, 2, 3]), one_row)
