"""The static decode step under torch.compile (`runtime/compiled.py`) on the CPU: traced by
Dynamo (the `aot_eager` backend: the captured graphs run as ATen ops, no generated kernels), it gives
bitwise the plain static step's logits across buckets in the engine's numerics; once shapes have gone
symbolic, a bucket reuses the compiled graphs; the weights' converted copies still come from the cache
(not converted inside the graph on every step); batch-invariant steps run the plain step. Inductor's
kernels, replayed from CUDA graphs over several buckets on an H200: test_cuda_graphs_gpu.py."""

import numpy as np
import pytest
import torch
from deepinfer_model import batch_invariant, numerics
from deepinfer_model.compile_boundary import outside_compiled_graph
from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
from deepinfer_model.models.deepseek_v41.paged import v41_static_decode_forward
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.runtime.compiled import compiled_static_forward
from deepinfer_model.runtime.cuda_graphs import DecodeGraphSettings
from deepinfer_model.testing import batch_of

BLOCK, NUM_BLOCKS, MAX_CTX = 4, 64, 64


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    m = load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41compiled"), seed=0))
    return DeepseekV41ForCausalLM(
        m.config, m.weights, m.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
    )


def _runners(model):
    def settings(compile):
        return DecodeGraphSettings(8, MAX_CTX, 4, capture=False, min_context_tier=16, compile=compile)

    return PagedRunner(model, NUM_BLOCKS, BLOCK, decode_graphs=settings(None)), PagedRunner(
        model, NUM_BLOCKS, BLOCK, decode_graphs=settings("aot_eager")
    )


def test_settings_reject_unknown_backend():
    with pytest.raises(ValueError, match="compile must be None or one of"):
        DecodeGraphSettings(8, 64, compile="tensorrt")
    with pytest.raises(ValueError, match="compile backend must be one of"):
        compiled_static_forward(v41_static_decode_forward, "tensorrt")


def test_compiled_static_step_equals_plain_bitwise(engine_model, monkeypatch):
    """Native numerics, engine model (FP32 master weights, BF16 activations, quantised KV): bucket 8
    compiles with the rows and table width symbolic, buckets 4, 8 and 2 and the next context tier reuse
    that graph, bucket 1 compiles once (a size of 1 is specialised) and is reused at the next tier; every
    step's logits are the plain static step's bit for bit. A traced `numerics.weight_as` would convert every master
    weight to BF16 inside the graph on every step: the compiled step must take the cached copies from
    outside its graph instead (the spy sees the conversions called at run time, never traced)."""
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    conversions = []
    real = numerics._converted_weight.__wrapped__

    def spy(weight, dtype):
        conversions.append(torch.compiler.is_compiling())
        return real(weight, dtype)

    monkeypatch.setattr(numerics, "_converted_weight", outside_compiled_graph(spy))
    torch._dynamo.reset()  # trace anew with the spy in place
    compiled_static_forward.cache_clear()
    try:
        plain, compiled = _runners(engine_model)
        assert compiled.graphs.forward is compiled_static_forward(v41_static_decode_forward, "aot_eager")
        assert plain.graphs.forward is v41_static_decode_forward
        rng = np.random.default_rng(0)
        seqs = []
        for i in range(7):  # 9 blocks (36 positions) each, scattered
            blocks = [int(b) for b in rng.permutation(9) + 9 * i]
            seqs.append({"id": i, "tokens": list(rng.integers(3, 256, 36)), "table": blocks, "n": 0})
        prompt = [10 + i % 3 for i in range(7)]
        for r in (plain, compiled):
            r.execute(batch_of(seqs, prompt, prompt))  # eager prefills
        for s, n in zip(seqs, prompt):
            s["n"] = n
        torch._dynamo.utils.counters.clear()
        graphs = []
        for live in (7, 3, 5, 2, 1, 7, 3, 1):  # buckets 8, 4, 8, 2, 1, then the next tier: 8, 4, 1
            batch = batch_of(seqs[:live], [1] * live)
            conversions.clear()
            a, b = plain.execute(batch), compiled.execute(batch)
            assert compiled.graphs.replays == plain.graphs.replays  # both ran the static step
            assert torch.equal(a, b), f"compiled static step != plain one ({live} sequences)"
            assert conversions and not any(conversions), "weights converted inside the traced graph"
            for s in seqs[:live]:
                s["n"] += 1
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        # one graph for every bucket of 2 or more rows at every tier, one for bucket 1: before the sizes were
        # marked dynamic (runtime/compiled.py), bucket 4 recompiled, and so did bucket 2 (a block size computed
        # from the rows in `grouped_index_scores`) and each bucket at each new tier
        assert graphs == [1, 1, 1, 1, 2, 2, 2, 2], graphs
        tiers = {tier for _, tier in compiled.graphs.metas}
        assert {b for b, _ in compiled.graphs.metas} == {1, 2, 4, 8} and len(tiers) == 2, (
            compiled.graphs.metas
        )
        # one graph per compile: the converted weights are read as graph inputs, the ops traced (the CPU
        # reference) or recorded as custom ops (top-k, RoPE frequencies, quantisation tables)
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0, torch._dynamo.utils.counters[
            "graph_break"
        ]
    finally:
        torch._dynamo.reset()
        compiled_static_forward.cache_clear()


def test_batch_invariant_steps_run_the_plain_step(engine_model, monkeypatch):
    _, compiled = _runners(engine_model)
    monkeypatch.setenv(batch_invariant.ENV, "1")
    assert compiled.graphs.forward is v41_static_decode_forward
    monkeypatch.setenv(batch_invariant.ENV, "0")
    assert compiled.graphs.forward is compiled_static_forward(v41_static_decode_forward, "aot_eager")
