"""Draft CUDA graphs on the GPU (`runtime.draft_graphs`): a greedy graph replay equals the same static
draft run without a graph bit for bit and the eager batched draft's tokens (confidence within 1e-5,
exact numerics), through padded sequence buckets captured on first use and replayed again with other
inputs; in native numerics the replay equals the uncaptured static draft bit for bit. Sampled drafts
the same way, q included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint  # noqa: E402
from deepinfer_model.runner import StepBatch  # noqa: E402
from deepinfer_model.runtime import PagedRunner  # noqa: E402
from deepinfer_model.runtime.cuda_graphs import DecodeGraphSettings  # noqa: E402
from deepinfer_model.sampling import RowParams  # noqa: E402
from deepinfer_model.testing.draft_reference import PerRowDraftReference  # noqa: E402

DEV = torch.device("cuda")
BLOCK, MAX_CTX, K = 4, 64, 3
LENGTHS = (3, 21, 8, 14, 5, 30, 2)
CASES = ([1], [4, 0, 2], [0, 1, 2, 3, 4], [6, 5, 1, 3, 0, 2, 4], [2, 3], [0, 4, 1])  # buckets 1, 4, 8, 2


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41draftgraphs_gpu"), seed=5)


def _runner(model, capture):
    settings = DecodeGraphSettings(
        8 * (1 + K), MAX_CTX, 4, capture=capture, max_query_len=1 + K, draft=True, capture_on_use=1
    )
    need = [-(-n // BLOCK) for n in LENGTHS]
    tables = np.split(np.random.default_rng(0).permutation(sum(need)).astype(np.int32), np.cumsum(need)[:-1])
    runner = PagedRunner(model, num_blocks=sum(need), block_size=BLOCK, decode_graphs=settings)
    runner.execute(
        StepBatch.of(
            seq_ids=np.arange(len(LENGTHS)),
            start_positions=np.zeros(len(LENGTHS), dtype=np.int64),
            query_lens=np.asarray(LENGTHS),
            block_tables=list(tables),
            input_ids=np.random.default_rng(1).integers(4, 256, sum(LENGTHS)),
            logits_lens=np.ones(len(LENGTHS), dtype=np.int64),
        )
    )
    return runner


def _model(path, native: bool, monkeypatch):
    """The checkpoint on the GPU: exact numerics, or native (BF16 activations, FP8 KV)."""
    if native:
        monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    model = load_v41(path, device=DEV)
    if native:
        model = DeepseekV41ForCausalLM(
            model.config, model.weights, model.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
        )
    return model


@pytest.mark.parametrize("native", [False, True])
def test_draft_graph_replay_equals_static_and_eager(path, native, monkeypatch):
    model = _model(path, native, monkeypatch)
    graphed, static = _runner(model, True), _runner(model, False)
    for i, seqs in enumerate(CASES):
        rng = np.random.default_rng(i)
        tokens = [int(t) for t in rng.integers(4, 256, len(seqs))]
        lasts = [int(rng.integers(0, LENGTHS[s])) for s in seqs] if i % 2 else None
        kw = dict(seq_indices=seqs, last_positions=lasts, tokens_only=True)
        g, s = graphed.draft(tokens, K, **kw), static.draft(tokens, K, **kw)
        e = static.draft(tokens, K, seq_indices=seqs, last_positions=lasts)
        for a, b, c in zip(g, s, e):
            assert a.tokens.device.type == "cuda"
            assert torch.equal(a.tokens, b.tokens), ("graph replay tokens != static", native, seqs)
            assert torch.equal(a.confidence, b.confidence), (
                "graph replay confidence != static",
                native,
                seqs,
            )
            assert torch.equal(a.positions, c.positions)
            if not native:
                # FP32: the same tokens as the eager draft, whose GEMMs have unpadded rows, so cuBLAS may
                # pick another kernel (another summation order) than for the bucket: last bits only.
                # (native: padding moves BF16 roundings too, so only the tokens mostly agree)
                assert torch.equal(a.tokens, c.tokens), (
                    "graph replay tokens != eager",
                    seqs,
                    a.tokens,
                    c.tokens,
                )
                diff = float((a.confidence.double() - c.confidence.double()).abs().max())
                assert diff <= 1e-5, ("graph replay confidence far from eager", seqs, diff)
    assert graphed.draft_graphs.replays == len(CASES) == static.draft_graphs.replays
    assert sorted(graphed.draft_graphs.graphs) == [1, 2, 4, 8]
    graphed.close()
    assert not graphed.draft_graphs.graphs


PARAMS = (  # cycled over the rows of each case: greedy, nucleus + min-p, top-k, plain
    RowParams(temperature=0.0),
    RowParams(temperature=0.8, top_p=0.9, min_p=0.02, seed=3),
    RowParams(temperature=1.3, top_k=5, seed=2**64 - 3),
    RowParams(temperature=0.6, seed=9),
)


@pytest.mark.parametrize("native", [False, True])
def test_sampled_draft_graph_replay_equals_static_and_eager(path, native, monkeypatch):
    """Sampled drafts (`runtime.draft_sampling`): the replay equals the uncaptured static draft bit for bit
    (tokens, confidence, q); against the eager draft with a per-row reference sampler, the tolerances of
    the greedy test above (FP32: same tokens, confidence and q within 1e-5; native: the replay's own)."""
    model = _model(path, native, monkeypatch)
    graphed, static = _runner(model, True), _runner(model, False)
    for i, seqs in enumerate(CASES):
        rng = np.random.default_rng(100 + i)
        tokens = [int(t) for t in rng.integers(4, 256, len(seqs))]
        lasts = [int(rng.integers(0, LENGTHS[s])) for s in seqs] if i % 2 else None
        # case 0: every row sampled without the sort pass; the others mixed, with it
        params = [PARAMS[3]] if i == 0 else [PARAMS[(i + j) % len(PARAMS)] for j in range(len(seqs))]
        seeds = [int(s) for s in rng.integers(0, 2**62, len(seqs))]
        positions = [int(p) for p in rng.integers(0, 500, len(seqs))]
        kw = dict(seq_indices=seqs, last_positions=lasts)
        g = graphed.draft(
            tokens, K, sampler=PerRowDraftReference(params, seeds, positions), tokens_only=True, **kw
        )
        s = static.draft(
            tokens, K, sampler=PerRowDraftReference(params, seeds, positions), tokens_only=True, **kw
        )
        ref = PerRowDraftReference(params, seeds, positions)
        e = static.draft(tokens, K, sampler=ref, **kw)
        for j, (a, b, c) in enumerate(zip(g, s, e)):
            assert torch.equal(a.tokens, b.tokens), ("sampled replay tokens != static", native, seqs)
            assert torch.equal(a.confidence, b.confidence), ("sampled replay confidence != static", native)
            assert (a.probs is None) == (b.probs is None) == params[j].greedy
            if a.probs is not None:
                assert a.probs.device.type == "cuda"
                assert torch.equal(a.probs, b.probs), ("sampled replay q != static", native, seqs)
            if not native:
                assert torch.equal(a.tokens, c.tokens), ("sampled replay tokens != eager", seqs)
                diff = float((a.confidence.double() - c.confidence.double()).abs().max())
                assert diff <= 1e-5, ("sampled replay confidence far from eager", seqs, diff)
                if a.probs is not None:
                    diff = float((a.probs - torch.stack(ref.q[j])).abs().max())
                    assert diff <= 1e-5, ("sampled replay q far from eager", seqs, diff)
    d = graphed.draft_graphs
    assert d.sampled_replays == len(CASES) == static.draft_graphs.sampled_replays
    assert sorted(d.sampled_graphs) == [(1, False), (2, True), (4, True), (8, True)]
    graphed.close()
    assert not d.sampled_graphs and d.q is None
