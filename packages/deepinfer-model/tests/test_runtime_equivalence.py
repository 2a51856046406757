"""The paged runner against the stateless forward: any chunking, any batch mix (prefill chunks, decodes,
multi-token verification rows), random block placement; tiny public V4 (SWA, CSA ratio 4 with overlap
and indexer, HCA ratio 8) and the §11 tiny V4.1 (SWA, C2, C1, sharing, candidates, YOCO, Engram).

Tolerance: FP32 CPU, 1e-5 relative to the row set's largest logit. By design the result is bitwise
(every block accumulates in FP64 and rounds at the same storage points whatever the batch), and the
deterministic test below asserts bitwise equality."""

import numpy as np
import pytest
import torch
from deepinfer_model import load_model
from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
from deepinfer_model.models.grouped_attention import sizes
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.testing import make_checkpoint, tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

RTOL = 1e-5


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("v4"), tiny_config(), seed=3, tokenizer=False))


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41"), seed=0))


@pytest.fixture(scope="module")
def v41_engine_numerics(v41):
    """BF16 activations and cache-format KV (FP8 SWA, FP4 main KV, FP4 index keys): the engine's numerics."""
    return DeepseekV41ForCausalLM(
        v41.config, v41.weights, v41.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
    )


def _logits(model, tokens) -> torch.Tensor:
    out = model.forward(torch.as_tensor(tokens))
    return out.logits if hasattr(out, "logits") else out


def run_random_schedule(model, rng: np.random.Generator, block_size: int, n_seqs: int, max_len: int):
    """Drive `PagedRunner` through a random interleaving of chunks of `n_seqs` sequences whose blocks are
    taken from a shuffled pool as they grow. Returns [(paged rows, reference rows)]."""
    vocab = model.config.vocab_size
    num_blocks = n_seqs * (-(-max_len // block_size)) + 3
    runner = PagedRunner(model, num_blocks=num_blocks, block_size=block_size)
    free = [int(b) for b in rng.permutation(num_blocks)]
    seqs = []
    for _ in range(n_seqs):
        toks = rng.integers(4, vocab, int(rng.integers(2, max_len + 1))).tolist()
        seqs.append(dict(tokens=toks, done=0, table=[], ref=_logits(model, toks)))
    pairs = []
    while any(s["done"] < len(s["tokens"]) for s in seqs):
        entries = []
        for sid, s in enumerate(seqs):
            left = len(s["tokens"]) - s["done"]
            if left == 0 or rng.random() < 0.25:
                continue
            # decode (1), verification-sized (2..5) or a prefill chunk (up to the rest)
            q = int(min(left, rng.choice([1, int(rng.integers(2, 6)), int(rng.integers(1, left + 1))])))
            end = s["done"] + q
            while len(s["table"]) * block_size < end:
                s["table"].append(free.pop())
            n_logits = int(rng.integers(0, q + 1))
            entries.append((sid, s["done"], q, n_logits))
            s["done"] = end
        if not entries:
            continue
        rng.shuffle(entries)
        batch = StepBatch.of(
            seq_ids=np.array([e[0] for e in entries]),
            start_positions=np.array([e[1] for e in entries]),
            query_lens=np.array([e[2] for e in entries]),
            block_tables=[np.array(seqs[e[0]]["table"], dtype=np.int32) for e in entries],
            input_ids=np.concatenate([seqs[e[0]]["tokens"][e[1] : e[1] + e[2]] for e in entries]),
            logits_lens=np.array([e[3] for e in entries]),
        )
        got = runner.execute(batch)
        assert got.shape == (batch.num_logits_rows, vocab)
        row = 0
        for sid, start, q, n in entries:
            pairs.append((got[row : row + n], seqs[sid]["ref"][start + q - n : start + q]))
            row += n
    return pairs


def _assert_close(pairs):
    got = torch.cat([p[0] for p in pairs])
    ref = torch.cat([p[1] for p in pairs])
    assert torch.isfinite(got).all()
    err = ((got - ref).abs().max() / ref.abs().max()).item() if len(ref) else 0.0
    assert err <= RTOL, f"max relative deviation {err:.2e} > {RTOL}"


SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([4, 8, 16]), n_seqs=st.integers(1, 3))
def test_v4_any_chunking_and_batch_mix_matches_forward(v4, seed, block_size, n_seqs):
    _assert_close(run_random_schedule(v4, np.random.default_rng(seed), block_size, n_seqs, max_len=26))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([2, 8, 16]), n_seqs=st.integers(1, 3))
def test_v41_any_chunking_and_batch_mix_matches_forward(v41, seed, block_size, n_seqs):
    _assert_close(run_random_schedule(v41, np.random.default_rng(seed), block_size, n_seqs, max_len=30))


@pytest.mark.parametrize("which", ["v4", "v41", "v41_engine_numerics"])
def test_bitwise_equal_to_forward(which, request):
    """The design's claim, asserted exactly on one fixed mixed schedule per model (also with BF16
    activations and quantised KV: every cached value is stored after its rounding)."""
    model = request.getfixturevalue(which)
    pairs = run_random_schedule(model, np.random.default_rng(7), 8, 3, max_len=34)
    assert sum(len(p[0]) for p in pairs) > 10
    for got, ref in pairs:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("which", ["v4", "v41", "v41_engine_numerics"])
def test_row_blocked_query_side_is_bitwise_equal_to_forward(which, request, monkeypatch):
    """Steps longer than a query block (4 rows here) run the query side of attention per row block of the
    packed rows (the path of a 64k-token prefill chunk): still the stateless forward, bit for bit."""
    model = request.getfixturevalue(which)
    cfg = model.config
    monkeypatch.setattr(sizes, "QUERY_BLOCK_ELEMENTS", 4 * cfg.num_attention_heads * cfg.head_dim)
    pairs = run_random_schedule(model, np.random.default_rng(7), 8, 3, max_len=34)
    assert sum(len(p[0]) for p in pairs) > 10
    for got, ref in pairs:
        assert torch.equal(got, ref)
