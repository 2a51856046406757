"""Graph-safe decode on the CPU: the static decode step equals the eager paged step, pads to
buckets without touching real rows, makes no host sync; bucket sizes follow spec engine.md §3.5; context
tiers size the step's block tables and index scoring by its longest context, not by max_context.

The CUDA graphs themselves are tested in `test_cuda_graphs_gpu.py` (marked gpu)."""

import numpy as np
import pytest
import torch
from deepinfer_model.layers.experts import ExpertWeights, MLPWeights, experts_forward, experts_forward_static
from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
from deepinfer_model.models.deepseek_v41.paged import static_decode_problem
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.runtime.cuda_graphs import (
    DecodeGraphSettings,
    build_context_tiers,
    build_graph_batch_sizes,
    decode_graph_settings,
)
from deepinfer_model.runtime.metadata import StepMetadata
from deepinfer_model.runtime.pools import PagedKVCache
from deepinfer_model.testing import batch_of, grow_tables
from deepinfer_model.testing.no_sync import HostSyncError, count_ops, no_host_sync

BLOCK, NUM_BLOCKS, MAX_CTX = 4, 96, 128
MIN_TIER = 8  # context tiers 8, 16, 32, 64, 128: the tests' steps move between them


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41graphs"), seed=0))


@pytest.fixture(scope="module")
def engine_numerics(model):
    """BF16 activations and quantised KV: the engine's numerics."""
    return DeepseekV41ForCausalLM(
        model.config, model.weights, model.engram.vocab, act_dtype=torch.bfloat16, quantize_kv=True
    )


def test_build_graph_batch_sizes():
    assert build_graph_batch_sizes(32, 8) == [1, 2, 4, 8, 16, 24, 32]
    assert build_graph_batch_sizes(30, 8) == [1, 2, 4, 8, 16, 24, 30]
    assert build_graph_batch_sizes(5, 8) == [1, 2, 4, 5]
    assert build_graph_batch_sizes(1, 8) == [1]
    assert build_graph_batch_sizes(8, 8) == [1, 2, 4, 8]
    assert build_graph_batch_sizes(20, 6) == [1, 2, 4, 6, 12, 18, 20]
    assert build_graph_batch_sizes(4, 1) == [1, 2, 3, 4]
    for bad in [(0, 8), (4, 0), (2.5, 8)]:
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            build_graph_batch_sizes(*bad)


def test_settings_only_on_cuda_and_not_when_eager():
    assert decode_graph_settings("cpu", 8, 64) is None
    assert decode_graph_settings("cuda", 8, 64, enforce_eager=True) is None
    assert decode_graph_settings("cuda", 8, 64) == DecodeGraphSettings(8, 64, 8)
    with pytest.raises(ValueError, match="max_context"):
        DecodeGraphSettings(8, 0)


class Pair:
    """The same steps through an eager runner and a static-decode runner (no capture: CPU)."""

    def __init__(self, model, max_batch=8, interval=4, seed=0, max_query_len=1, min_tier=MIN_TIER):
        self.eager = PagedRunner(model, NUM_BLOCKS, BLOCK)
        settings = DecodeGraphSettings(
            max_batch,
            MAX_CTX,
            interval,
            capture=False,
            max_query_len=max_query_len,
            min_context_tier=min_tier,
        )
        self.static = PagedRunner(model, NUM_BLOCKS, BLOCK, decode_graphs=settings)
        self.rng = np.random.default_rng(seed)
        self.free = [int(b) for b in self.rng.permutation(NUM_BLOCKS)]
        self.seqs = []
        self.keys = []  # (bucket, tier) of every static step

    def add(self, prompt_len):
        seq = {
            "id": len(self.seqs),
            "tokens": list(self.rng.integers(3, 256, prompt_len)),
            "table": [],
            "n": 0,
        }
        self.seqs.append(seq)
        return seq

    def batch(self, seqs, qlens, llens=None):
        grow_tables(seqs, qlens, self.free, BLOCK)
        return batch_of(seqs, qlens, llens)

    def verify(self, seqs, ks):
        """A verification step: sequence i feeds its next token and ks[i] drafts (random ids: the runner
        does not care whether they will be accepted), logits for all 1 + k rows. Then a random number
        a <= k of them is 'accepted': the sequence keeps them plus the target's token after the last
        accepted one (its argmax), and the rejected rows' cache slots are rewritten by the next step."""
        for s, k in zip(seqs, ks):
            s["tokens"] = s["tokens"][: s["n"] + 1] + [int(t) for t in self.rng.integers(3, 256, k)]
        qlens = [1 + k for k in ks]
        batch = self.batch(seqs, qlens, qlens)
        a, b, graphed = self._both(batch)
        row = 0
        for s, k in zip(seqs, ks):
            acc = int(self.rng.integers(0, k + 1))
            s["n"] += 1 + acc
            s["tokens"] = s["tokens"][: s["n"]] + [int(torch.argmax(a[row + acc]))]
            row += 1 + k
        return a, b, graphed

    def _both(self, batch):
        """Both runners' logits for `batch`, and whether the static runner replayed a (bucket, tier);
        the keys replayed are collected in `self.keys`."""
        replays = self.static.graphs.replays
        a, b = self.eager.execute(batch), self.static.execute(batch)
        graphed = self.static.graphs.replays > replays
        if graphed:
            meta = self.static._last_meta
            self.keys.append(self.static.graphs.key(meta))
        return a, b, graphed

    def step(self, seqs, qlens):
        batch = self.batch(seqs, qlens)
        a, b, graphed = self._both(batch)
        for s, q in zip(seqs, qlens):
            s["n"] += q
            s["tokens"].append(int(torch.argmax(a[seqs.index(s)])))  # greedy continuation
        return a, b, graphed


def _run_mixed(model, steps=6):
    pair = Pair(model)
    seqs = [pair.add(n) for n in (5, 11, 3, 75, 8, 2, 9)]  # 75: candidate blocks restrict
    _, _, graphed = pair.step(seqs, [len(s["tokens"]) for s in seqs])  # prefill: eager
    assert not graphed
    out = []
    for i in range(steps):
        # varying subsets: 7, 5, 3, 1, ... tokens -> buckets 8, 8, 4, 1 (padding rows in most steps)
        live = seqs[: max(1, 7 - 2 * (i % 4))]
        a, b, graphed = pair.step(live, [1] * len(live))
        assert graphed
        out.append((a, b))
    # a mixed prefill + decode step runs eagerly and still sees the static steps' cache writes
    extra = pair.add(6)
    a, b, graphed = pair.step([seqs[0], extra], [1, 6])
    assert not graphed
    out.append((a, b))
    return pair, out


def test_static_decode_equals_eager_bitwise(model):
    """Exact mode, FP32: every decode step's logits equal the eager paged step's bit for bit."""
    _, out = _run_mixed(model)
    for a, b in out:
        assert torch.equal(a, b)


def test_static_decode_equals_eager_engine_numerics(engine_numerics):
    """BF16 activations + quantised KV (the roundings the engine stores): still bitwise in exact mode."""
    _, out = _run_mixed(engine_numerics, steps=4)
    for a, b in out:
        assert torch.equal(a, b)


def test_static_decode_native_mode_close(engine_numerics, monkeypatch):
    """Native (FP32 carrier) mode: same rounding points; the expert products are batched differently,
    so equal within FP32 / BF16 rounding rather than bitwise."""
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    _, out = _run_mixed(engine_numerics, steps=3)
    for a, b in out:
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_placeholders_write_only_the_dummy_block(model):
    """Padding rows change no pool row outside the dummy block, and real rows ignore what is there."""
    pair = Pair(model)
    seqs = [pair.add(n) for n in (6, 9, 4)]
    pair.step(seqs, [len(s["tokens"]) for s in seqs])
    cache = pair.static.cache
    before = {k: v.clone() for k, v in cache.pools.items()}
    pair.step(seqs, [1, 1, 1])  # 3 tokens -> bucket 4: one placeholder row
    dummy = NUM_BLOCKS
    for name, pool in cache.pools.items():
        per = cache.specs[name].slots_per_block
        inside = torch.zeros(pool.shape[0], dtype=torch.bool)
        inside[dummy * per : (dummy + 1) * per] = True
        changed = ~((pool == before[name]) | (pool.isnan() & before[name].isnan())).all(dim=1)
        used = {b for s in seqs for b in s["table"]}
        owner = torch.arange(pool.shape[0]) // per
        real = torch.tensor([int(o) in used for o in owner])
        assert not (changed & ~inside & ~real).any(), name
    # poison the dummy block: real rows of the next step are unaffected
    for name, pool in cache.pools.items():
        per = cache.specs[name].slots_per_block
        pool[dummy * per : (dummy + 1) * per] = 1e30 if pool.dtype.is_floating_point else 7
    a, b, graphed = pair.step(seqs, [1, 1, 1])
    assert graphed and torch.equal(a, b)


def test_static_decode_makes_no_host_sync(model):
    """The static decode forward under `no_host_sync` (fails on item / nonzero / bool-mask indexing /
    host tensors made from data); the eager decode step trips it (the checker is not vacuous)."""
    pair, _ = _run_mixed(model, steps=1)
    runner = pair.static
    seqs = pair.seqs[:3]
    batch = pair.batch(seqs, [1] * len(seqs))  # one token each
    from deepinfer_model.runtime.metadata import StepMetadata

    meta = StepMetadata.build(batch, BLOCK, NUM_BLOCKS, vocab_size=256)
    g = runner.graphs
    b, tier = g.key(meta)
    g._fill(b, tier, meta, batch.input_ids)
    with no_host_sync():
        static = g.forward(runner.model, g.meta(b, tier), runner.cache)[:3]
    eager = pair.eager.execute(batch)
    assert torch.equal(static, eager)
    with pytest.raises(HostSyncError):
        with no_host_sync():
            pair.eager.execute(batch)


def test_no_host_sync_catches_each_kind():
    x = torch.arange(6.0)
    for fn in (
        lambda: x.sum().item(),
        lambda: int(x[0]),
        lambda: x.nonzero(),
        lambda: x[x > 2],
        lambda: x.tolist(),
        lambda: torch.as_tensor(np.arange(3)),
        lambda: torch.unique(x),
        lambda: bool(x.any()),
        lambda: x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1])),
    ):
        with pytest.raises(HostSyncError):
            with no_host_sync():
                fn()
    with no_host_sync():  # fixed-shape device work passes
        torch.where(x > 2, x, 0).sort().values.cumsum(0)


def test_static_experts_equal_loop_exact():
    """The per-pair expert path equals the per-expert loop bitwise in exact mode (FP32 and BF16
    roundings), including repeated experts, unused experts and routing weight before / after w2; 90 pairs:
    more than one `PAIR_CHUNK` of gathered weights, the last chunk partial."""
    from deepinfer_model.layers.experts import PAIR_CHUNK

    g = torch.Generator().manual_seed(0)
    e, inter, hidden, t, k = 6, 16, 24, 30, 3
    assert PAIR_CHUNK < t * k < 2 * PAIR_CHUNK
    ex = ExpertWeights(
        *(torch.randn(e, *s, generator=g) for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    )
    sh = MLPWeights(
        *(torch.randn(*s, generator=g) for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    )
    x = torch.randn(t, hidden, generator=g).double()
    ids = torch.randint(0, e - 1, (t, k), generator=g)  # expert e-1 unused
    ids[0] = ids[1]  # repeated rows
    w = torch.rand(t, k, generator=g)
    for act in (torch.float32, torch.bfloat16):
        for wbd in (False, True):
            ref = experts_forward(x, w, ids, ex, sh, 7.0, act, wbd)
            got = experts_forward_static(x, w, ids, ex, sh, 7.0, act, wbd)
            assert torch.equal(ref, got)


def test_static_experts_grouped_native(monkeypatch):
    """Native mode: the grouped GEMM and the per-pair path agree with the loop and with a float64 oracle
    within FP32 rounding of the output's scale (outputs reach ~190 here, where one FP32 ulp is 1.5e-5: how
    the BLAS orders a 32-term sum moves results by about that much, e.g. bmm on an AVX-512 host)."""
    g = torch.Generator().manual_seed(1)
    e, inter, hidden, t, k = 5, 32, 16, 7, 2
    ex = ExpertWeights(
        *(torch.randn(e, *s, generator=g) for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    )
    x = torch.randn(t, hidden, generator=g)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    monkeypatch.setenv("DEEPINFER_NUMERICS", "exact")
    ex64 = ExpertWeights(ex.w1.double(), ex.w3.double(), ex.w2.double())
    oracle = experts_forward(x.double(), w.double(), ids, ex64, None, 7.0, torch.float64, True)
    tol = 4 * torch.finfo(torch.float32).eps * float(oracle.abs().max())
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    ref = experts_forward(x, w, ids, ex, None, 7.0, torch.float32, True)
    torch.testing.assert_close(ref.double(), oracle, rtol=0, atol=tol)
    for method in ("gather", "grouped"):
        got = experts_forward_static(x, w, ids, ex, None, 7.0, torch.float32, True, method=method)
        torch.testing.assert_close(got, ref, rtol=0, atol=tol)
        torch.testing.assert_close(got.double(), oracle, rtol=0, atol=tol)
    with no_host_sync():
        experts_forward_static(x, w, ids, ex, None, 7.0, torch.float32, True, method="grouped")


def test_grouped_native_sum_is_the_slot_sum_of_the_pair_rows(monkeypatch):
    """Native mode's grouped method sums each token's routed rows and the shared expert in one op
    (`expert_swiglu_sum`): bitwise what the per-pair op's rows give through `_slot_sum` (slot order from
    zeros, the shared expert last, one rounding), for BF16 and FP32 roundings and both weight orders; with
    BF16 activations the sum comes as a BF16 tensor."""
    from deepinfer_model.layers.experts import _slot_sum, grouped_swiglu
    from deepinfer_model.numerics import weight_as

    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    g = torch.Generator().manual_seed(2)
    e, inter, hidden, t, k = 5, 32, 16, 9, 3
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    ex = ExpertWeights(*(torch.randn(e, *s, generator=g) for s in shapes))
    sh = MLPWeights(*(torch.randn(*s, generator=g) for s in shapes))
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    for act in (torch.bfloat16, torch.float32):
        x = torch.randn(t, hidden, generator=g).to(act).float()
        ops = [weight_as(m, act) for m in (ex.w1, ex.w3, ex.w2)]
        for wbd in (False, True):
            got = experts_forward_static(x, w, ids, ex, sh, 7.0, act, wbd, method="grouped")
            rows = grouped_swiglu(x.to(act), ids.reshape(-1), w.reshape(-1), *ops, 7.0, wbd)
            ref = _slot_sum(rows.view(t, k, -1), x, sh, 7.0, act)
            # (BF16 activations: the sum as a BF16 tensor, `numerics.narrow_act`; the same values)
            assert ref.dtype == torch.float32 and got.dtype == act
            assert torch.equal(got.float(), ref)


def test_ineligible_steps_and_models(model):
    pair = Pair(model, max_batch=2, interval=2)
    seqs = [pair.add(4) for _ in range(3)]
    _, _, graphed = pair.step(seqs, [4, 4, 4])
    assert not graphed  # prefill
    a, b, graphed = pair.step(seqs, [1, 1, 1])
    assert not graphed and torch.equal(a, b)  # 3 tokens > largest bucket 2
    a, b, graphed = pair.step(seqs[:2], [1, 1])
    assert graphed and torch.equal(a, b)
    assert static_decode_problem(object()) is not None
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        PagedRunner(model, 8, BLOCK, decode_graphs=DecodeGraphSettings(2, 16))


def test_host_ops_per_decode_step(model):
    """Dispatched ATen ops (kernel launches on CUDA) and host syncs of one 4-sequence decode forward,
    eager vs static (the measurement quoted in the runtime README)."""
    from deepinfer_model.models.deepseek_v41.paged import v41_paged_forward
    from deepinfer_model.runtime.metadata import StepMetadata

    pair, _ = _run_mixed(model, steps=1)
    seqs = pair.seqs[:4]
    batch = pair.batch(seqs, [1] * len(seqs))  # one token each
    meta = StepMetadata.build(batch, BLOCK, NUM_BLOCKS, vocab_size=256)
    pair.eager.cache.write("token_ids", meta.write_slots, meta.input_ids)
    with count_ops() as eager:
        a = v41_paged_forward(model, meta, pair.eager.cache)
    g = pair.static.graphs
    key = g.key(meta)
    g._fill(*key, meta, batch.input_ids)
    with count_ops() as static:
        b = g.forward(model, g.meta(*key), pair.static.cache)
    assert torch.equal(a, b)
    assert eager.syncs > 0 and static.syncs == 0
    print(
        f"decode forward, 4 sequences: eager {eager.ops} ops / {eager.syncs} syncs; static {static.ops} ops"
    )


NEXTN = 3


def _run_verify(model, steps=6, seed=0):
    """Verification steps (1 + k tokens per sequence, k in 0 .. NEXTN varying per sequence and step, a
    random accepted prefix) through the eager and the static runner, over padded token buckets."""
    pair = Pair(model, max_batch=4 * (1 + NEXTN), interval=4, seed=seed, max_query_len=1 + NEXTN)
    seqs = [pair.add(n) for n in (5, 11, 3, 70, 8)]  # 70: candidate blocks restrict
    _, _, graphed = pair.step(seqs, [len(s["tokens"]) for s in seqs])  # prefill: eager
    assert not graphed
    out, buckets = [], set()
    for i in range(steps):
        live = seqs[i % 2 : i % 2 + 4]
        ks = [int(k) for k in pair.rng.integers(0, NEXTN + 1, len(live))]
        if i == 0:
            ks = [NEXTN] * len(live)  # the full bucket: 16 tokens
        a, b, graphed = pair.verify(live, ks)
        assert graphed, ks
        buckets.add(pair.static.graphs.select(sum(ks) + len(live)))
        out.append((a, b))
    assert pair.static.graphs.verify_replays == steps
    # the drafter reads the draft_main keys the static step wrote (last accepted positions)
    for k, s in enumerate(live):
        last = s["n"] - 1
        d_e = pair.eager.draft([s["tokens"][-1]], 2, seq_indices=[k], last_positions=[last])[0]
        d_s = pair.static.draft([s["tokens"][-1]], 2, seq_indices=[k], last_positions=[last])[0]
        assert torch.equal(d_e.tokens, d_s.tokens) and torch.equal(d_e.logits, d_s.logits)
    # a step with a long prefill chunk runs eagerly and sees every static step's cache writes
    extra = pair.add(7)
    a, b, graphed = pair.step([seqs[0], extra], [1, 7])
    assert not graphed
    out.append((a, b))
    return pair, out, buckets


def test_static_verify_equals_eager_bitwise(model):
    """Exact mode, FP32: every verification step's logits (all 1 + k rows of every sequence) equal the
    eager paged step's bit for bit, over several padded buckets and accepted lengths."""
    _, out, buckets = _run_verify(model)
    assert len(buckets) >= 2 and 16 in buckets
    for a, b in out:
        assert torch.equal(a, b)


def test_static_verify_equals_eager_engine_numerics(engine_numerics):
    _, out, _ = _run_verify(engine_numerics, steps=4, seed=1)
    for a, b in out:
        assert torch.equal(a, b)


def test_static_verify_makes_no_host_sync(model):
    """A verification step's static forward under `no_host_sync`; its eager counterpart trips it."""
    pair, _, _ = _run_verify(model, steps=1)
    seqs = pair.seqs[:3]
    for s in seqs:
        s["tokens"] = s["tokens"][: s["n"] + 1] + [5, 6, 7]
    batch = pair.batch(seqs, [4, 2, 3], [4, 2, 3])
    from deepinfer_model.runtime.metadata import StepMetadata

    meta = StepMetadata.build(batch, BLOCK, NUM_BLOCKS, vocab_size=256)
    g = pair.static.graphs
    assert g.problem(meta) is None
    b, tier = g.key(meta)
    assert b == g.select(9)
    g._fill(b, tier, meta, batch.input_ids)
    with no_host_sync():
        static = g.forward(pair.static.model, g.meta(b, tier), pair.static.cache)[:9]
    assert torch.equal(static, pair.eager.execute(batch))
    with pytest.raises(HostSyncError):
        with no_host_sync():
            pair.eager.execute(batch)


def test_verify_eligibility():
    """Steps whose sequences feed more than max_query_len tokens, or exceed the largest bucket, run eagerly;
    the engine's settings size the buckets by max_num_seqs x (1 + nextn)."""
    s = decode_graph_settings("cuda", 8, 64, nextn=5)
    assert (s.max_batch_size, s.max_query_len) == (48, 6)
    assert build_graph_batch_sizes(s.max_batch_size, s.interval) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    with pytest.raises(ValueError, match="nextn"):
        decode_graph_settings("cuda", 8, 64, nextn=-1)
    with pytest.raises(ValueError, match="max_query_len"):
        DecodeGraphSettings(4, 64, max_query_len=5)


def test_verify_ineligible_steps(model):
    pair = Pair(model, max_batch=6, interval=2, max_query_len=3)
    seqs = [pair.add(4) for _ in range(3)]
    pair.step(seqs, [4, 4, 4])
    a, b, graphed = pair.verify(seqs, [3, 0, 0])  # 4 tokens for one sequence > max_query_len 3
    assert not graphed and torch.equal(a, b)
    a, b, graphed = pair.verify(seqs, [2, 2, 1])  # 8 tokens > the largest bucket 6
    assert not graphed and torch.equal(a, b)
    a, b, graphed = pair.verify(seqs, [2, 1, 0])  # 6 tokens: the largest bucket, unpadded
    assert graphed and torch.equal(a, b)


def test_static_step_reads_only_selected_entries(model, monkeypatch):
    """Compressed keys: the static step gathers each row's top-k selected entries from the comp pools
    ([rows, index_topk], whatever max_context is), where the eager step reads every entry of a sequence;
    the logits stay bitwise equal. (The pool reads are recorded by wrapping `PagedKVCache.read`.)"""
    pair, _, _ = _run_verify(model, steps=1)
    seqs = pair.seqs[:4]  # contexts up to ~75 entries at ratio 1, index_topk 8
    for s in seqs:
        s["tokens"] = s["tokens"][: s["n"] + 1]
    reads = {"eager": [], "static": []}
    real_read = PagedKVCache.read

    def recording(self, name, slots):
        if name.startswith("comp."):
            reads["static" if self is pair.static.cache else "eager"].append(tuple(slots.shape))
        return real_read(self, name, slots)

    monkeypatch.setattr(PagedKVCache, "read", recording)
    a, b, graphed = pair.step(seqs, [1] * 4)
    assert graphed and torch.equal(a, b)
    topk = model.config.index_topk
    assert reads["static"] and all(shape == (4, topk) for shape in reads["static"]), reads["static"]
    assert max(shape[1] for shape in reads["eager"]) > 4 * topk  # eager: every entry of the group


def test_build_context_tiers():
    assert build_context_tiers(4096) == [256, 512, 1024, 2048, 4096]
    assert build_context_tiers(3000) == [256, 512, 1024, 2048, 3000]
    assert build_context_tiers(128, 8) == [8, 16, 32, 64, 128]
    assert build_context_tiers(100, 8, 4) == [8, 32, 100]
    assert build_context_tiers(256) == [256] and build_context_tiers(64) == [64]  # one tier: max_context
    for bad in [(0, 8), (64, 0), (64, 8, 1), (64, 2.5)]:
        with pytest.raises(ValueError, match="must be an integer >= "):
            build_context_tiers(*bad)
    with pytest.raises(ValueError, match="min_context_tier"):
        DecodeGraphSettings(8, 64, min_context_tier=0)


@pytest.mark.parametrize("numerics", ["fp32", "engine"])
def test_static_steps_cross_context_tiers(model, engine_numerics, numerics):
    """Decode and verification steps whose longest context moves up through the tiers 8 .. 128 (a
    verification step's 1 + k rows may straddle a tier boundary): each runs the smallest tier >= its
    longest context (after the step) and its logits equal the eager step's bit for bit (exact mode, FP32
    and BF16 + quantised KV); padded buckets included."""
    m = model if numerics == "fp32" else engine_numerics
    pair = Pair(m, max_batch=4 * (1 + NEXTN), interval=4, seed=3, max_query_len=1 + NEXTN)
    tiers = pair.static.graphs.tiers
    assert tiers == [8, 16, 32, 64, 128]
    a_seq, b_seq, c_seq = pair.add(5), pair.add(2), pair.add(27)
    # b holds more blocks than its context needs (as a scheduler's lookahead may): 40 tokens' worth,
    # wider than the small tiers' tables, whose columns past the tier are never used
    b_seq["table"] = [pair.free.pop() for _ in range(10)]
    pair.step([a_seq, b_seq], [5, 2])  # prefill (eager)
    schedule = [  # (sequences, drafts per sequence or None for a plain decode step)
        ([a_seq, b_seq], None),  # longest context 6 -> tier 8
        ([a_seq], [3]),  # 7 + 3 -> 10: straddles 8 | 16
        ([a_seq, b_seq], [NEXTN, 1]),
        ([a_seq, b_seq], None),
        ([a_seq], [NEXTN]),
        ([a_seq, b_seq], [2, 2]),
    ]
    out = []
    for live, ks in schedule:
        ends = max(s["n"] for s in live) + (1 if ks is None else 1 + max(ks))
        a, b, graphed = pair.step(live, [1] * len(live)) if ks is None else pair.verify(live, ks)
        assert graphed and pair.keys[-1][1] == min(t for t in tiers if t >= ends), (ends, pair.keys[-1])
        out.append((a, b))
    pair.step([c_seq], [27])  # prefill (eager)
    for i in range(5):  # c: 28 .. 32 -> tier 32, then 33 -> tier 64 while a / b stay short
        live = [c_seq, a_seq] if i % 2 else [c_seq, a_seq, b_seq]
        ends = max(s["n"] for s in live) + 1 + (NEXTN if i == 4 else 0)
        a, b, graphed = (
            pair.verify(live, [NEXTN] + [0] * (len(live) - 1)) if i == 4 else pair.step(live, [1] * len(live))
        )
        assert graphed and pair.keys[-1][1] == min(t for t in tiers if t >= ends), (ends, pair.keys[-1])
        out.append((a, b))
    used = {t for _, t in pair.keys}
    assert {8, 16, 32, 64} <= used, used
    for a, b in out:
        assert torch.equal(a, b)


def test_index_scoring_follows_context_tier(model, monkeypatch):
    """The unrestricted index sources score index keys up to the step's context tier: at contexts <= 16
    with max_context 128, a tiered runner reads at most 16 // ratio index keys per row where a runner
    with one tier (the previous behaviour) reads 128 // ratio; the same logits, both == eager."""
    reads = {}
    real_read = PagedKVCache.read

    def recording(self, name, slots):
        if name.startswith("index_k."):
            reads.setdefault(id(self), []).append(tuple(slots.shape))
        return real_read(self, name, slots)

    logits = {}
    for min_tier in (MIN_TIER, MAX_CTX):
        pair = Pair(model, min_tier=min_tier)
        seqs = [pair.add(n) for n in (5, 11, 3)]
        pair.step(seqs, [len(s["tokens"]) for s in seqs])  # prefill
        monkeypatch.setattr(PagedKVCache, "read", recording)
        a, b, graphed = pair.step(seqs, [1, 1, 1])  # longest context 12 -> tier 16 (of 8 .. 128)
        monkeypatch.setattr(PagedKVCache, "read", real_read)
        assert graphed and torch.equal(a, b)
        logits[min_tier] = b
        widths = [shape[1] for shape in reads[id(pair.static.cache)]]
        # per index source, in layer order: a restricted one reads its candidate blocks' keys ([rows,
        # blocks x block size], the same for both runners), the others every key up to the tier
        cfg, topo = model.config, model.config.topology
        cand = topo.candidate_topk_blocks * topo.candidate_block_size
        tier = 16 if min_tier == MIN_TIER else MAX_CTX
        expect = [
            cand if topo.restricted_to_candidates(layer) else tier // ratio
            for layer, ratio in enumerate(cfg.compress_ratios[: topo.num_layers])
            if ratio and topo.is_index_source(layer)
        ]
        assert widths == expect, (min_tier, widths, expect)
        assert any(w == tier // 1 for w in widths)  # a ratio-1 source: MAX_CTX keys without tiers
    assert torch.equal(logits[MIN_TIER], logits[MAX_CTX])


# ------------------------------------------------------------------ batch-invariant mode
# With DEEPINFER_BATCH_INVARIANT=1 the static decode / verification step (what a CUDA graph replays) gives
# logits bitwise equal to the eager batch-invariant paged step, makes no host sync, and a sequence's row
# does not depend on the other rows of the step; the runner replays it. The replay on CUDA:
# test_cuda_graphs_gpu.py::test_graph_replay_equals_eager_batch_invariant.


@pytest.fixture
def bi(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


@pytest.mark.parametrize("numerics", ["fp32", "engine"])
def test_static_decode_equals_eager_batch_invariant(model, engine_numerics, numerics, bi):
    """Decode steps of 7, 5, 3, 1 sequences (padded buckets, contexts up to 80 with candidate-restricted
    selection) replay the static step and equal the eager BI step bit for bit; a mixed prefill step
    runs eagerly afterwards and still matches (it reads the static steps' cache writes)."""
    pair, out = _run_mixed(model if numerics == "fp32" else engine_numerics, steps=4)
    assert pair.static.graphs.replays == 4
    for a, b in out:
        assert torch.equal(a, b)


@pytest.mark.parametrize("numerics", ["fp32", "engine"])
def test_static_verify_equals_eager_batch_invariant(model, engine_numerics, numerics, bi):
    """Verification steps (1 + k rows per sequence, k in 0 .. 3, padded buckets up to 16 tokens): every
    row bitwise the eager BI step's (whose rows of a sequence share a tile layout and query blocks)."""
    _, out, _ = _run_verify(model if numerics == "fp32" else engine_numerics, steps=3, seed=2)
    for a, b in out:
        assert torch.equal(a, b)


def _static_logits(pair, seqs, qlens, rows):
    """The static forward of the step feeding `qlens` tokens of `seqs` (no state advanced), rows `rows`."""
    batch = pair.batch(seqs, qlens, qlens)
    meta = StepMetadata.build(batch, BLOCK, NUM_BLOCKS, vocab_size=256)
    g = pair.static.graphs
    assert g.problem(meta) is None
    key = g.key(meta)
    g._fill(*key, meta, batch.input_ids)
    with no_host_sync():
        out = g.forward(pair.static.model, g.meta(*key), pair.static.cache)
    return out[rows], batch


def test_static_batch_invariant_no_host_sync_and_alone_vs_batch(engine_numerics, bi):
    """A sequence's static-step logits (decode row and a verification block) are the same alone and among
    3 others with other contexts (another context tier, another bucket), under `no_host_sync`; equal to
    the eager BI step; the eager BI step itself trips the checker (not vacuous)."""
    pair, _, _ = _run_verify(engine_numerics, steps=1, seed=4)
    seqs = pair.seqs[:4]  # contexts from a few tokens to ~75 (tiers 16 .. 128)
    for s in seqs:
        s["tokens"] = s["tokens"][: s["n"] + 1] + [9, 10, 11]
    short = min(seqs, key=lambda s: s["n"])
    others = [s for s in seqs if s is not short]
    alone, _ = _static_logits(pair, [short], [1], slice(0, 1))
    mixed, batch = _static_logits(pair, [others[0], short, *others[1:]], [1] * 4, slice(0, 4))
    assert pair.static.graphs.key(StepMetadata.build(batch, BLOCK, NUM_BLOCKS, vocab_size=256)) != (1, 8)
    assert torch.equal(alone[0], mixed[1])
    assert torch.equal(mixed, pair.eager.execute(batch))
    # a verification block of 4 rows: alone vs after two other sequences' blocks
    v_alone, _ = _static_logits(pair, [short], [4], slice(0, 4))
    v_mixed, batch = _static_logits(pair, [others[0], others[1], short], [2, 3, 4], slice(5, 9))
    assert torch.equal(v_alone, v_mixed)
    assert torch.equal(v_mixed, pair.eager.execute(batch)[5:9])
    with pytest.raises(HostSyncError):
        with no_host_sync():
            pair.eager.execute(batch)


def test_batch_invariant_mode_switch_runs_eagerly(model, monkeypatch):
    """Steps replay in BI mode; a runner whose graphs were captured under one (numerics, BI) mode sends a
    step under another to the eager path (the BI layout is baked into a captured graph)."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    pair = Pair(model)
    seqs = [pair.add(n) for n in (5, 9)]
    pair.step(seqs, [5, 9])
    a, b, graphed = pair.step(seqs, [1, 1])
    assert graphed and torch.equal(a, b)
    g = pair.static.graphs
    batch = pair.batch(seqs, [1, 1])
    meta = StepMetadata.build(batch, BLOCK, NUM_BLOCKS, vocab_size=256)
    g.mode = ("exact", False)  # as after a capture outside BI mode (no capture on the CPU)
    assert "DEEPINFER_BATCH_INVARIANT=0" in g.problem(meta)
    g.mode = ("exact", True)
    assert g.problem(meta) is None


def test_batch_invariant_graphs_can_be_turned_off(model, monkeypatch):
    """Batch-invariant steps replay graphs by default (`batch_invariant=True`, the engine's
    DEEPINFER_CUDAGRAPH_BATCH_INVARIANT); with False they run eagerly, captured or not."""
    from deepinfer_model.runtime.cuda_graphs import DecodeGraphRunner

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    pair = Pair(model)
    runner = pair.static.graphs
    seqs = [pair.add(n) for n in (5, 9)]
    pair.step(seqs, [len(s["tokens"]) for s in seqs])  # prefill (eager)
    meta = StepMetadata.build(pair.batch(seqs, [1, 1]), BLOCK, NUM_BLOCKS, vocab_size=256)
    assert runner.problem(meta) is None  # the default, uncaptured (the CPU's static path): allowed
    captured = object.__new__(DecodeGraphRunner)
    captured.__dict__.update(runner.__dict__)
    for capture in (True, False):
        captured.settings = DecodeGraphSettings(8, MAX_CTX, 4, capture=capture, min_context_tier=MIN_TIER)
        assert captured.problem(meta) is None
        captured.settings = DecodeGraphSettings(
            8, MAX_CTX, 4, capture=capture, min_context_tier=MIN_TIER, batch_invariant=False
        )
        assert "batch-invariant graphs are off" in captured.problem(meta)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    assert captured.problem(meta) is None  # the switch matters only in batch-invariant mode
    assert decode_graph_settings("cuda", 8, 64).batch_invariant and decode_graph_settings("cuda", 8, 64).draft
    assert not decode_graph_settings("cuda", 8, 64, batch_invariant=False).batch_invariant
