"""Decode CUDA graphs on the GPU (issue #13): graph replays equal the eager paged step for several batch
sizes, padded ones included, in exact and native numerics; the static step replayed from a graph
equals the same static step run without a graph bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint  # noqa: E402
from deepinfer_model.runner import RunnerBatch  # noqa: E402
from deepinfer_model.runtime import PagedRunner  # noqa: E402
from deepinfer_model.runtime.cuda_graphs import DecodeGraphSettings  # noqa: E402

DEV = torch.device("cuda")
BLOCK, NUM_BLOCKS, MAX_CTX = 4, 96, 128
SIZES = [1, 3, 4, 5, 8, 2, 7]  # buckets 1, 2, 4, 8: most steps padded


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41graphs_gpu"), seed=0)


def _model(path, engine_numerics: bool):
    m = load_v41(path, device=DEV)
    if engine_numerics:
        m = DeepseekV41ForCausalLM(
            m.config, m.weights, m.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
        )
    return m


def _drive(runners, steps=SIZES, seed=0):
    """The same prefill then decode steps (greedy on runners[0]'s logits) through every runner."""
    rng = np.random.default_rng(seed)
    free = [int(b) for b in rng.permutation(NUM_BLOCKS)]
    seqs = [
        {"id": i, "tokens": list(rng.integers(3, 256, n)), "table": [], "n": 0}
        for i, n in enumerate((5, 40, 3, 17, 8, 2, 9, 11))
    ]

    def step(live, qlens):
        for s, q in zip(live, qlens):
            while len(s["table"]) * BLOCK < s["n"] + q:
                s["table"].append(free.pop())
        batch = RunnerBatch(
            seq_ids=np.array([s["id"] for s in live]),
            start_positions=np.array([s["n"] for s in live]),
            query_lens=np.array(qlens),
            block_tables=[np.array(s["table"], dtype=np.int32) for s in live],
            input_ids=np.array([t for s, q in zip(live, qlens) for t in s["tokens"][s["n"] : s["n"] + q]]),
            logits_lens=np.ones(len(live), dtype=np.int64),
        )
        outs = [r.execute(batch) for r in runners]
        for i, (s, q) in enumerate(zip(live, qlens)):
            s["n"] += q
            s["tokens"].append(int(torch.argmax(outs[0][i])))
        return outs

    step(seqs, [len(s["tokens"]) for s in seqs])
    return [step(seqs[:n], [1] * n) for n in steps]


@pytest.mark.parametrize("native", [False, True])
def test_graph_replay_equals_eager(path, native, monkeypatch):
    if native:
        monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    model = _model(path, engine_numerics=native)
    eager = PagedRunner(model, NUM_BLOCKS, BLOCK)
    static = PagedRunner(
        model, NUM_BLOCKS, BLOCK, decode_graphs=DecodeGraphSettings(8, MAX_CTX, 4, capture=False)
    )
    graphs = PagedRunner(model, NUM_BLOCKS, BLOCK, decode_graphs=DecodeGraphSettings(8, MAX_CTX, 4))
    assert sorted(graphs.graphs.graphs) == [1, 2, 4, 8]
    results = _drive([eager, static, graphs])
    assert graphs.graphs.replays == len(SIZES)
    bitwise = 0
    for n, (a, s, g) in zip(SIZES, results):
        assert g.shape == (n, model.config.vocab_size) and g.device.type == "cuda"
        assert torch.equal(g, s), f"graph replay != static step without graph at {n} tokens"
        if native:
            torch.testing.assert_close(g, a, rtol=2e-2, atol=2e-2)
        else:
            torch.testing.assert_close(g, a, rtol=1e-6, atol=1e-6)
        assert torch.equal(g.argmax(-1), a.argmax(-1))
        bitwise += torch.equal(g, a)
    print(f"numerics {'native' if native else 'exact'}: {bitwise}/{len(SIZES)} steps bitwise equal to eager")
    graphs.close()
    assert not graphs.graphs.graphs
