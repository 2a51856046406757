"""Batch-invariant mode through the paged runtime, step by step: a request's logits are bitwise identical
whatever shares its steps (prefill chunks, decode rows, verification blocks of other lengths and context
sizes), however its own prompt and continuation are split into steps (chunks, single decodes, verify
blocks), and whether its prefix blocks were computed by another sequence (a prefix-cache hit).

`tests/test_repro_batch_invariance.py` drives the scheduler (which picks the batching); here the steps
are built by hand, so every neighbour kind meets the target in a known step. The attention kernel of
the mode (`batch_invariant.sink_attention`) is checked on its own at FP64, bit for bit, where a
last-bit change cannot hide behind the rounding to FP32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.default_model import resolve_model
from deepinfer_model import batch_invariant, load_model
from deepinfer_model.batch_invariant import fixed_bmm, key_layout, tile_products, weight_parts
from deepinfer_model.layers.attention import sink_attention
from deepinfer_model.models.deepseek_v41.paged import attention as paged_attention
from deepinfer_model.models.grouped_attention import sizes
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.runtime.device import model_device

BLOCK = 16
KT = batch_invariant.KEY_TILE
# every check runs on the CPU, and with the model / tensors on CUDA where there is a GPU
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.fixture(autouse=True)
def _invariant_mode(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return load_model(resolve_model(None)[0], torch.float32, device=request.param)


# ----------------------------------------------------------------------------- the attention kernel
def _place(q_row, keys, vis, frame, b_count, m_count, target_b, target_m, front_tiles, width_tiles, g):
    """A batch of `b_count` key sets x `m_count` queries with the target query (q_row, its keys at
    absolute frame `frame`, its visibility) at [target_b, target_m]; everything else random."""
    nh, d = q_row.shape
    s = width_tiles * KT
    q = torch.randn(b_count, m_count, nh, d, generator=g, dtype=torch.float64)
    kk = torch.randn(b_count, s, d, generator=g, dtype=torch.float64)
    vv = torch.rand(b_count, m_count, s, generator=g) < 0.5
    col = front_tiles * KT + frame % KT
    q[target_b, target_m] = q_row
    kk[target_b] = torch.randn(s, d, generator=g, dtype=torch.float64)  # invisible columns: any value
    kk[target_b, col : col + len(keys)] = keys
    vv[target_b, target_m] = False
    vv[target_b, target_m, col : col + len(keys)] = vis
    return q, kk, vv


@pytest.mark.parametrize("device", DEVICES)
def test_attention_kernel_row_is_bitwise_batch_invariant_and_exact(device):
    g = torch.Generator().manual_seed(0)
    nh, d, n = 4, 128, 45
    q_row = torch.randn(nh, d, generator=g, dtype=torch.float64)
    keys = torch.randn(n, d, generator=g, dtype=torch.float64)
    vis = torch.rand(n, generator=g) < 0.7
    sinks = torch.randn(nh, generator=g)
    frame = 37  # the first key's absolute position: column 5 of its tile
    results = []
    for b_count, m_count, tb, tm, front, extra in [
        (1, 1, 0, 0, 0, 0),
        (1, 9, 0, 4, 0, 1),
        (3, 1, 2, 0, 2, 0),
        (5, 7, 1, 6, 1, 3),
        (2, 64, 1, 33, 0, 2),
    ]:
        width = front + batch_invariant.key_tiles(frame % KT + n) // KT + extra
        q, kk, vv = _place(q_row, keys, vis, frame, b_count, m_count, tb, tm, front, width, g)
        q, kk, vv = q.to(device), kk.to(device), vv.to(device)
        results.append(batch_invariant.sink_attention(q, kk, vv, sinks.to(device), 0.088)[tb, tm].cpu())
    for k, r in enumerate(results[1:], 1):
        assert torch.equal(r, results[0]), f"composition {k} changed the FP64 attention output"
    # and it is sink attention: a float64 computation one head at a time
    for h in range(nh):
        s = (keys[vis] @ q_row[h]) * 0.088
        e = torch.exp(torch.cat((s, sinks[h : h + 1].double())) - max(s.max(), sinks[h].double()))
        ref = (e[:-1, None] * keys[vis]).sum(0) / e.sum()
        torch.testing.assert_close(results[0][h], ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
def test_tiled_scores_do_not_depend_on_neighbours_or_width(device):
    """The indexer's scores in the mode: one (query row, key) dot product whatever shares the call."""
    g = torch.Generator().manual_seed(4)
    row = torch.randn(128, generator=g, dtype=torch.float64)
    keys = torch.randn(KT, 128, generator=g, dtype=torch.float64)
    outs = []
    for b_count, r_count, width_tiles, tb, tr in [(1, 1, 1, 0, 0), (3, 13, 2, 1, 9), (2, 64, 4, 1, 40)]:
        q = torch.randn(b_count, r_count, 128, generator=g, dtype=torch.float64)
        k = torch.randn(b_count, width_tiles * KT, 128, generator=g, dtype=torch.float64)
        q[tb, tr], k[tb, :KT] = row, keys
        outs.append(batch_invariant.tiled_scores(q.to(device), k.to(device))[tb, tr, :KT].cpu())
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    exact = torch.tensor(
        [float(np.dot(row.numpy(), keys[j].numpy())) for j in range(KT)], dtype=torch.float64
    )
    torch.testing.assert_close(outs[0], exact, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_row_gemm_rows_do_not_depend_on_the_batch(threads):
    """The CPU linear of the mode (`row_gemm`): a row's FP64 result is the same for every row count M
    (1 = a GEMV included) and position in the batch, for FP32-valued rows (one GEMM, exact products) and
    full-FP64 rows (fixed 8-row tiles) mixed in one batch, FP32 weights and full-FP64 weights (split in
    three exact parts), odd N and odd K; and it is the matrix product."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(11)
    try:
        for k, n, w_dtype in [
            (128, 64, torch.float32),
            (129, 77, torch.float32),
            (96, 1, torch.float64),
            (512, 24, torch.float32),
            (64, 3000, torch.float32),
            (300, 33, torch.float64),
        ]:
            w = torch.randn(n, k, generator=g, dtype=w_dtype)
            x = torch.randn(300, k, generator=g, dtype=torch.float64)
            x[::2] = x[::2].float().double()  # FP32-valued rows (most GEMM inputs) among full-FP64 rows
            full = batch_invariant.row_gemm(x, w.t())
            for m in (*range(1, 18), 31, 32, 33, 64, 129, 257):
                for start in (0, 1, 7):
                    out = batch_invariant.row_gemm(x[start : start + m], w.t())
                    assert torch.equal(out, full[start : start + m]), (k, n, m, start)
            torch.testing.assert_close(full, x @ w.double().t(), rtol=1e-12, atol=1e-12)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_gemm_rows_of_deep_wide_weights_do_not_depend_on_m(threads):
    """FP32-valued rows against a deep, wide FP32 weight (K = 1024, N = 256), all in the exact-product
    GEMM: a row's bits are the same for M = 1 .. 600. On an AVX-512 host a single MKL GEMM gave other bits
    below ~192 rows than above (K split at M-dependent points), and for one or two rows; the K blocks and
    minimum rows of `_cpu_gemm` fix that."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(12)
        w_t = torch.randn(256, 1024, generator=g).t()
        x = torch.randn(600, 1024, generator=g).double()
        full = batch_invariant.row_gemm(x, w_t, fp32_valued=True)
        for m in (1, 2, 3, 5, 64, 191, 192, 193, 400):
            for start in (0, 5):
                out = batch_invariant.row_gemm(x[start : start + m], w_t, fp32_valued=True)
                assert torch.equal(out, full[start : start + m]), (m, start)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_row_gemm_rows_of_a_wide_weight_do_not_depend_on_m(threads):
    """A weight of at least `WIDE_BYTES` in FP64 (the LM head's case): 4..32 FP32-valued rows take the NT
    GEMM against the stored layout, other counts the NN GEMM; a row gets the same bits from both, so it
    is the same for every M and position, and it is the matrix product. K = 300 spans three K blocks."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(13)
        k = 300
        n = batch_invariant.WIDE_BYTES // (8 * k) + 5  # just over the threshold, N not a multiple of COL_PAD
        w = torch.randn(n, k, generator=g)
        x = torch.randn(80, k, generator=g).double()
        assert weight_parts._row_major(w.t())[1] is not None  # the NT copy exists: both layouts run
        full = batch_invariant.row_gemm(x, w.t(), fp32_valued=True)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 31, 32, 33, 70):
            for start in (0, 3):
                out = batch_invariant.row_gemm(x[start : start + m], w.t(), fp32_valued=True)
                assert torch.equal(out, full[start : start + m]), (m, start)
        torch.testing.assert_close(full, x @ w.double().t(), rtol=1e-12, atol=1e-12)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_gemm_rows_do_not_depend_on_the_batch(threads):
    """`grouped_gemm` (all experts of a projection in one bmm, groups zero-padded to the longest): a row's
    FP64 result is the same whether it is computed alone (M = 1) or among M = 3, 8, 37 rows spread
    over the groups in any way, for FP32-valued rows and full-FP64 rows (the SwiGLU output, whose low
    part adds one more row), stacked [E, N, K] weights side by side and a single [N, K] weight; and it
    is the matrix product (against a float64 GEMM)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(21)
    try:
        for e, k, ns in [(5, 128, (64, 64)), (4, 64, (128,)), (3, 96, (77,)), (1, 512, (24,))]:
            ws = [torch.randn(e, n, k, generator=g) for n in ns]
            parts = batch_invariant.stacked_parts(*ws)
            assert parts.shape == (e, k, -(-sum(ns) // 16) * 16)
            w_t = torch.cat([w.double().transpose(1, 2) for w in ws], dim=2)  # [E, K, sum N]
            x = torch.randn(40, k, generator=g, dtype=torch.float64)
            x[::2] = x[::2].float().double()  # FP32-valued rows among full-FP64 rows
            grp = torch.randint(0, e, (40,), generator=g)

            alone = {i: _grouped_rows([i], x, grp, parts, e, sum(ns))[i] for i in range(40)}
            for i in range(40):
                torch.testing.assert_close(alone[i], x[i] @ w_t[grp[i]], rtol=1e-12, atol=1e-12)
            for m in (3, 8, 37, 40):
                for seed in range(2):
                    pick = torch.randperm(40, generator=torch.Generator().manual_seed(seed))[:m].tolist()
                    for i, row in _grouped_rows(pick, x, grp, parts, e, sum(ns)).items():
                        assert torch.equal(row, alone[i]), (e, k, ns, m, i)
    finally:
        torch.set_num_threads(before)


def _grouped_rows(rows, x, grp, parts, e, n):
    """{row: `grouped_gemm` result} for rows `rows` of x in groups `grp`, sorted by group (as the experts are)."""
    rows = sorted(rows, key=lambda i: int(grp[i]))
    counts = torch.bincount(grp[rows], minlength=e).tolist()
    out = batch_invariant.grouped_gemm(x[rows], counts, parts)[:, :n]
    for loop in (False, True):  # one padded bmm, one mm per group: the same bits
        assert torch.equal(batch_invariant.grouped_gemm(x[rows], counts, parts, loop=loop)[:, :n], out)
    return dict(zip(rows, out, strict=True))


def test_stacked_parts_declines_what_grouped_gemm_cannot_take(monkeypatch):
    """Weights that are not FP32-valued (products would not be exact) or too large to hold in FP64 get
    None (the experts then take `row_gemm` per expert); in-place updates refresh the cached copy."""
    g = torch.Generator().manual_seed(22)
    w = torch.randn(3, 32, 64, generator=g)
    assert batch_invariant.stacked_parts(w.double() / 3) is None
    first = batch_invariant.stacked_parts(w)
    w.mul_(2.0)
    assert torch.equal(batch_invariant.stacked_parts(w), 2.0 * first)
    monkeypatch.setattr(weight_parts, "PART_CACHE_BYTES", 1024)
    assert batch_invariant.stacked_parts(torch.randn(3, 32, 64, generator=g)) is None
    with pytest.raises(ValueError, match="counts"):
        batch_invariant.grouped_gemm(torch.zeros(4, 64, dtype=torch.float64), [1, 2, 0], first)


def test_bi_experts_rows_do_not_depend_on_the_other_tokens():
    """The routed experts and the shared expert in the mode (grouped GEMMs): a token's output is bitwise
    the same alone and among 36 others routed anywhere, and close to the per-expert loop of the
    default mode (the same roundings, other FP64 sums)."""
    from deepinfer_model.layers.experts import ExpertWeights, MLPWeights, experts_forward

    g = torch.Generator().manual_seed(23)
    e, i_size, h = 6, 32, 64
    ex = ExpertWeights(
        *(torch.randn(e, *s, generator=g) / 8 for s in ((i_size, h), (i_size, h), (h, i_size)))
    )
    sh = MLPWeights(*(torch.randn(*s, generator=g) / 8 for s in ((i_size, h), (i_size, h), (h, i_size))))
    x = torch.randn(37, h, generator=g).double()
    w = torch.rand(37, 2, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(37)])
    for before in (False, True):
        full = experts_forward(x, w, ids, ex, sh, 7.0, torch.float32, before)
        for t in (0, 5, 36):
            alone = experts_forward(
                x[t : t + 1], w[t : t + 1], ids[t : t + 1], ex, sh, 7.0, torch.float32, before
            )
            assert torch.equal(alone[0], full[t])
            assert torch.equal(
                experts_forward(x[t:], w[t:], ids[t:], ex, sh, 7.0, torch.float32, before)[0], full[t]
            )
    torch.testing.assert_close(
        full,
        _default_mode(lambda: experts_forward(x, w, ids, ex, sh, 7.0, torch.float32, True)),
        rtol=1e-6,
        atol=1e-6,
    )


def _default_mode(fn):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "0")
        return fn()


def test_cpu_row_gemm_weight_copy_follows_in_place_updates():
    g = torch.Generator().manual_seed(12)
    w = torch.randn(40, 32, generator=g)
    x = torch.randn(5, 32, generator=g, dtype=torch.float64)
    first = batch_invariant.row_gemm(x, w.t())
    w.mul_(2.0)  # exact: every product and sum doubles
    assert torch.equal(batch_invariant.row_gemm(x, w.t()), 2.0 * first)
    assert batch_invariant.row_gemm(x[:0], w.t()).shape == (0, 40)


def test_chunked_bmm_is_the_plain_bmm():
    """The fixed-batch bmm of accelerators (calls of exactly `chunk` matrices), run on the CPU: same
    products, for broadcast (weight) and per-matrix right operands, any batch count."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(37, 8, 24, generator=g, dtype=torch.float64)
    b = torch.randn(37, 24, 5, generator=g, dtype=torch.float64)
    w = torch.randn(24, 5, generator=g, dtype=torch.float64)[None].expand(37, -1, -1)
    for n in (1, 15, 16, 17, 37):
        assert torch.equal(batch_invariant.bmm(a[:n], b[:n], chunk=16), torch.bmm(a[:n], b[:n]))
        assert torch.equal(batch_invariant.bmm(a[:n], w[:n], chunk=16), torch.bmm(a[:n], w[:n]))
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        batch_invariant.bmm(a, b, chunk=0)


def test_chunked_tiled_matmul_is_the_tile_products():
    """`tiled_matmul` with chunks (the accelerators' path, run on the CPU), which pads the rows once to
    whole chunks of tiles: each row is its fixed-tile product, the same as without chunks, any row count."""
    g = torch.Generator().manual_seed(4)
    w_t = torch.randn(48, 20, generator=g, dtype=torch.float64)
    x = torch.randn(300, 48, generator=g, dtype=torch.float64)
    for m in (0, 1, 7, 8, 9, 127, 128, 129, 300):
        plain = batch_invariant.tiled_matmul(x[:m], w_t)
        assert plain.shape == (m, 20)
        assert torch.equal(batch_invariant.tiled_matmul(x[:m], w_t, chunk=16), plain), m


def test_batched_tile_products_equal_the_per_tile_loop(monkeypatch):
    """The accelerators' `_tile_products` (every product in one gathered list, chunked as off the CPU) gives bitwise the products of the per-tile loop, for shared (Ta = 1) and per-tile left
    operands, more row tiles than sequences and fewer."""
    g = torch.Generator().manual_seed(5)
    for bsz, r, t in ((1, 1, 5), (1, 3, 4), (6, 1, 5), (4, 2, 3), (2, 5, 1)):
        for ta in (1, t):
            a = torch.randn(bsz, r, ta, 8, 12, generator=g, dtype=torch.float64)
            b = torch.randn(bsz, t, 12, 7, generator=g, dtype=torch.float64)
            loop = tile_products._tile_products(a, b, batched=False)
            assert loop.shape == (bsz, r, t, 8, 7)
            with monkeypatch.context() as m:  # calls of 16 matrices, as on a GPU
                m.setattr(fixed_bmm, "bmm", lambda x, y, chunk=None, bmm=fixed_bmm.bmm: bmm(x, y, 16))
                batched = tile_products._tile_products(a, b, batched=True)
            assert torch.equal(batched, loop), (bsz, r, t, ta)
    # with `seen`, the loop skips the unseen products (+0) and the batched list computes them: the seen
    # ones are the same bits
    seen = np.random.default_rng(0).random((bsz, r, t)) < 0.5
    skipped = tile_products._tile_products(a, b, seen, batched=False)
    every = tile_products._tile_products(a, b, seen, batched=True)
    assert torch.equal(every[torch.from_numpy(seen)], skipped[torch.from_numpy(seen)])
    assert not skipped[torch.from_numpy(~seen)].any()


def test_zero_padding_is_one_kernel_of_zeros():
    """`_pad0` appends exact zeros (from one cached zero, read by the cat) and returns its input unpadded."""
    x = torch.randn(3, 5, dtype=torch.float64)
    assert fixed_bmm._pad0(x, 0) is x
    y = fixed_bmm._pad0(x, 2, dim=1)
    assert (
        y.shape == (3, 7)
        and torch.equal(y[:, :5], x)
        and torch.equal(y[:, 5:], torch.zeros(3, 2, dtype=x.dtype))
    )
    assert not torch.signbit(y[:, 5:]).any()  # +0, as new_zeros gave
    from deepinfer_model.testing.no_sync import count_ops

    with count_ops() as ops:
        fixed_bmm._pad0(x, 4)
    assert ops.ops <= 2  # the expand view and the cat; no fill


def test_default_attention_row_depends_on_padding(monkeypatch):
    """Why the kernel exists: the default path's FP64 row changes with the key padding around it."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 128, generator=g, dtype=torch.float64)
    keys = torch.randn(40, 128, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g)
    base = sink_attention(q, keys[:9], torch.ones(1, 9, dtype=torch.bool), sinks, 0.088)
    padded = [
        sink_attention(q, keys[: 9 + p], torch.arange(9 + p)[None] < 9, sinks, 0.088) for p in range(1, 31)
    ]
    assert any(not torch.equal(base, x) for x in padded)


def test_attention_kernel_rejects_untiled_keys():
    with pytest.raises(ValueError, match="multiple of KEY_TILE"):
        batch_invariant.sink_attention(
            torch.zeros(1, 1, 2, 8),
            torch.zeros(1, KT + 1, 8),
            torch.ones(1, 1, KT + 1, dtype=torch.bool),
            torch.zeros(2),
            1.0,
        )


# -------------------------------------------------------------------------- through the paged runner
class _Sim:
    """Sequences on one PagedRunner with hand-built steps. Each sequence owns a token stream (its ids
    at every position, fixed in advance: teacher forcing, so every scenario feeds the same tokens).

    `attention[p]` records the target's (sid 0) FP64 attention output at position p, layer after layer,
    as the runner's grouped attention returns it (observed, not replaced): logits are FP32, and an FP64
    last-bit difference would rarely survive the rounding, so invariance is also checked before it."""

    def __init__(self, model, monkeypatch, num_blocks=64):
        self.runner = PagedRunner(model, num_blocks=num_blocks, block_size=BLOCK)
        self.free = list(range(num_blocks))
        self.seqs = {}  # id -> [tokens, computed, block table]
        self.attention: dict[int, list[torch.Tensor]] = {}
        self._ids: list[int] = []
        real = getattr(
            paged_attention.attend, "real", paged_attention.attend
        )  # not an earlier _Sim's observer

        def observed(*args):  # attend(q, window keys, group, sinks, scale, meta, extra)
            out = real(*args)
            g = args[2]
            owner = np.repeat(np.asarray(g.seqs), g.qmask.sum(dim=1).cpu().numpy())
            for r, (i, p) in enumerate(zip(owner, g.q_pos[g.qmask].tolist())):
                if self._ids[i] == 0:
                    self.attention.setdefault(p, []).append(out[r].clone())
            return out

        observed.real = real
        monkeypatch.setattr(paged_attention, "attend", observed)

    def add(self, sid, tokens, shared_blocks=(), computed=0):
        need = -(-len(tokens) // BLOCK) - len(shared_blocks)
        table = list(shared_blocks) + [self.free.pop(0) for _ in range(need)]
        self.seqs[sid] = [list(tokens), computed, np.array(table, dtype=np.int32)]

    def step(self, plan):
        """plan: [(sid, n_tokens, logits_rows)]; returns {sid: logits [logits_rows, V]}."""
        ids, starts, qlens, tables, inputs, nlog = [], [], [], [], [], []
        for sid, n, rows in plan:
            toks, done, table = self.seqs[sid]
            ids.append(sid)
            starts.append(done)
            qlens.append(n)
            tables.append(table)
            inputs += toks[done : done + n]
            nlog.append(rows)
            self.seqs[sid][1] = done + n
        self._ids = ids
        logits = self.runner.execute(
            StepBatch.of(
                seq_ids=np.array(ids, dtype=np.int64),
                start_positions=np.array(starts, dtype=np.int64),
                query_lens=np.array(qlens, dtype=np.int64),
                block_tables=tables,
                input_ids=np.array(inputs, dtype=np.int64),
                logits_lens=np.array(nlog, dtype=np.int64),
            )
        )
        out, row = {}, 0
        for sid, _n, rows in plan:
            out[sid] = logits[row : row + rows].clone()
            row += rows
        return out


def _stream(rng, n):
    return rng.integers(1000, 90_000, n).tolist()


TARGET_PROMPT = 37  # crosses two block boundaries and many compression blocks (ratio 2)
TARGET_LEN = 52  # prompt + 15 continuation tokens, fed as decodes / verify blocks


def _target_logits(sim, plans):
    """Run `plans` (lists of steps); collect the target's (sid 0) logits by absolute position."""
    by_pos = {}
    for plan in plans:
        before = {sid: sim.seqs[sid][1] for sid, _, _ in plan}
        out = sim.step(plan)
        for sid, n, rows in plan:
            if sid == 0:
                end = before[0] + n
                for k in range(rows):
                    by_pos[end - rows + k] = out[0][k]
    return by_pos


@pytest.mark.parametrize("shared_cols", [0, batch_invariant.KEY_TILE, batch_invariant.SHARED_ENTRY_COLS])
def test_target_logits_identical_across_neighbours_splits_and_prefix_hits(model, monkeypatch, shared_cols):
    # shared_cols: the entry count up to which a query's selected entries are shared entry-tile columns
    # rather than its own keys. None (the layout off the CPU): own keys only. One tile: the target's later
    # positions take own keys (ratio-1 layers);
    # two (the default): the target stays shared over two entry tiles while its long neighbours take own
    # keys, so a layout chosen per step rather than per query changes its bits (checked: it fails then)
    monkeypatch.setattr(key_layout, "SHARED_ENTRY_COLS", shared_cols)
    assert batch_invariant.shared_entry_cols("cpu") == shared_cols  # the runtime reads the patched value
    rng = np.random.default_rng(5)
    target = _stream(rng, TARGET_LEN)
    neigh = {sid: _stream(rng, 120) for sid in (1, 2, 3, 4)}

    sims = []
    # A: alone; the prompt in one step (logits at every position), then one decode per step
    sim = _Sim(model, monkeypatch)
    sim.add(0, target)
    sims.append(sim)
    alone = _target_logits(
        sim, [[(0, TARGET_PROMPT, TARGET_PROMPT)]] + [[(0, 1, 1)]] * (TARGET_LEN - TARGET_PROMPT)
    )

    # B: chunked 5 / 16 / 9 / 7, continuation as verify blocks 4 / 1 / 6 / 4; every step shares the batch
    # with neighbours of another kind and context: long prefill chunks, decodes, verify blocks
    sim = _Sim(model, monkeypatch)
    sim.add(0, target)
    for sid, toks in neigh.items():
        sim.add(sid, toks)
    sims.append(sim)
    sim.step([(1, 60, 1), (2, 3, 1), (3, 33, 0), (4, 8, 8)])  # give the neighbours some history
    mixed = _target_logits(
        sim,
        [
            [(1, 1, 1), (0, 5, 5), (3, 20, 0)],  # decode + target chunk + prefill chunk
            [(2, 4, 4), (0, 16, 16), (4, 1, 1), (1, 1, 1)],  # verify block + decodes
            [(0, 9, 9), (3, 30, 1)],
            [(4, 7, 7), (2, 1, 1), (0, 7, 7), (1, 5, 5)],
            [(0, 4, 4), (1, 4, 4), (2, 2, 2), (3, 1, 1), (4, 1, 1)],  # target verify block of 4
            [(3, 12, 1), (0, 1, 1)],
            [(0, 6, 6), (2, 1, 1)],
            [(1, 1, 1), (0, 4, 4), (4, 30, 1)],
        ],
    )

    # C: a prefix-cache hit: another sequence computed the first two blocks, the target reuses them
    sim = _Sim(model, monkeypatch)
    sim.add(9, target[: 2 * BLOCK] + _stream(rng, 3))
    sim.step([(9, 2 * BLOCK + 3, 1)])
    sim.add(0, target, shared_blocks=sim.seqs[9][2][:2], computed=2 * BLOCK)
    sim.add(2, neigh[2])
    sims.append(sim)
    sim.step([(2, 40, 1)])
    cached = _target_logits(
        sim, [[(2, 1, 1), (0, TARGET_PROMPT - 2 * BLOCK, 5)], [(0, 3, 3), (2, 2, 2)]] + [[(0, 3, 3)]] * 4
    )

    att = [x.attention for x in sims]
    layers = model.config.num_hidden_layers
    assert all(len(a[p]) == layers for a in att for p in a)
    for p in sorted(att[0]):
        for name, other in (("neighbours / splitting", att[1]), ("the prefix-cache hit", att[2])):
            if p in other:
                same = [torch.equal(x, y) for x, y in zip(att[0][p], other[p])]
                assert all(same), f"position {p}: {name} changed the FP64 attention output (layers {same})"
    assert len(alone) == TARGET_LEN and len(mixed) == TARGET_LEN and len(cached) == TARGET_LEN - 2 * BLOCK
    for p in sorted(alone):
        assert torch.equal(alone[p], mixed[p]), f"position {p}: neighbours / splitting changed the logits"
        if p in cached:
            assert torch.equal(alone[p], cached[p]), f"position {p}: the prefix-cache hit changed the logits"
    # the reference: the stateless forward over the whole stream, every position
    ref = model.forward(torch.tensor(target, device=model_device(model))).logits.float()
    diff = [p for p in sorted(alone) if not torch.equal(alone[p], ref[p])]
    assert not diff, f"paged runner differs from the stateless forward at positions {diff}"


def test_row_blocked_long_step_gives_the_same_bits(model, monkeypatch):
    """A step longer than a query block runs the query side of attention per row block (the 64k prefill
    path): the target's attention and logits keep every bit, the block edges cutting its prompt and the
    boundary to a neighbour's chunk."""
    rng = np.random.default_rng(7)
    target, neigh = _stream(rng, TARGET_PROMPT), _stream(rng, 50)
    sim = _Sim(model, monkeypatch)
    sim.add(0, target)
    whole = sim.step([(0, TARGET_PROMPT, TARGET_PROMPT)])[0]
    cfg = model.config
    monkeypatch.setattr(sizes, "QUERY_BLOCK_ELEMENTS", 7 * cfg.num_attention_heads * cfg.head_dim)
    blocked_sim = _Sim(model, monkeypatch)
    blocked_sim.add(1, neigh)
    blocked_sim.add(0, target)
    blocked = blocked_sim.step([(1, 12, 1), (0, TARGET_PROMPT, TARGET_PROMPT)])[0]  # blocks of 7 rows
    for p in range(TARGET_PROMPT):
        same = [torch.equal(x, y) for x, y in zip(sim.attention[p], blocked_sim.attention[p], strict=True)]
        assert all(same), f"position {p}: row blocks changed the FP64 attention output (layers {same})"
    assert torch.equal(whole, blocked)


def test_product_indices_used_by_a_graph_capture_are_never_evicted(monkeypatch):
    """`_tile_products_batched`'s cached index tensors: an entry a CUDA-graph capture reads is kept for good
    (the graph reads that memory at every replay), while the eager cache is emptied when full."""
    dev = torch.device(
        "cuda"
    )  # (only the key: the entry below is seeded by hand, nothing is allocated there)
    key = (2, 3, 1, 4, dev)
    seeded = (torch.arange(24), torch.arange(24))
    monkeypatch.setattr(tile_products, "_PRODUCT_INDICES", {key: seeded})
    monkeypatch.setattr(tile_products, "_CAPTURED_INDICES", {})
    monkeypatch.setattr(tile_products, "PRODUCT_INDEX_CACHE", 2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tile_products._product_indices(2, 3, 1, 4, dev) is seeded
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cpu = torch.device("cpu")
    for n in range(1, 6):  # fills and empties the eager cache
        ia, ib = tile_products._product_indices(1, 1, 1, n, cpu)
        assert ia.tolist() == [0] * n and ib.tolist() == list(range(n))
    assert key not in tile_products._PRODUCT_INDICES
    assert tile_products._product_indices(2, 3, 1, 4, dev) is seeded
