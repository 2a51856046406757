"""`DEEPINFER_NUMERICS=native` (FP32 carrier, act-dtype GEMMs) against the exact FP64-carrier reference.

Measured on the §11 tiny V4.1 (seed 0, the three prompts below, CPU):
* FP32 activations: teacher-forced logits within 8.4e-7 relative of exact (tolerance 1e-5), every
  teacher-forced argmax and every greedy continuation equal.
* BF16 activations (attention / indexer products on BF16 operands, P rounded to BF16): native differs
  from exact-BF16 by 1.37e-1 relative (top-1 0.88; 5.2e-2 / 0.92 when those products were FP32). That
  is BF16 noise, not a native-mode defect: exact-BF16 itself differs from exact-FP32 by 1.4e-1 (top-1
  0.94) on this random model (the indexer's and router's top-k amplify single-bit flips), and
  native-BF16 is closer to exact-FP32 than that (8.1e-2, top-1 0.94). So the test
  bounds native-BF16 against exact-FP32 by the BF16 noise floor measured in the same run (1.5x its
  error, top-1 at most 0.1 lower), and native-BF16 vs exact-BF16 absolutely (rel <= 0.15, top-1 >= 0.85).
* Paged runner vs stateless forward, both native FP32: max |diff| within 1e-5 of the largest logit
  (measured <= 1.5e-6; rows see other GEMM shapes than in the stateless forward, so FP32 sums may differ
  in the last bits; exact mode is bitwise, `test_runtime_equivalence.py`).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from deepinfer_model import batch_invariant, numerics
from deepinfer_model.models.deepseek_v41 import DeepseekV41ForCausalLM, load_v41, make_v41_checkpoint
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner
from deepinfer_model.testing import strict_device

FP32_RTOL = 1e-5  # measured 8.3e-7
PAGED_RTOL = 1e-5  # of the largest |logit| of the compared rows
GREEDY_STEPS = 6


@contextlib.contextmanager
def numerics_mode(mode: str | None, bi: str | None = None):
    """Set DEEPINFER_NUMERICS (and DEEPINFER_BATCH_INVARIANT) for the block, restore both afterwards."""
    saved = {k: os.environ.get(k) for k in (numerics.ENV, batch_invariant.ENV)}
    try:
        for k, v in ((numerics.ENV, mode), (batch_invariant.ENV, bi)):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return load_v41(make_v41_checkpoint(tmp_path_factory.mktemp("v41native"), seed=0))


def with_act(model, act):
    return DeepseekV41ForCausalLM(model.config, model.weights, model.engram.vocab, act_dtype=act)


PROMPTS = [np.random.default_rng(0).integers(4, 256, n) for n in (40, 64, 25)]


def teacher_forced(model, mode):
    with numerics_mode(mode):
        return torch.cat([model.forward(torch.as_tensor(p)).logits.double() for p in PROMPTS])


def greedy(model, mode, prompt, steps=GREEDY_STEPS, block=16):
    """Prefill `prompt` through the paged runner, then `steps` greedy decode steps: the tokens."""
    with numerics_mode(mode):
        n_blocks = -(-(len(prompt) + steps) // block)
        runner = PagedRunner(model, num_blocks=n_blocks, block_size=block)
        table = [np.arange(n_blocks, dtype=np.int32)]

        def step(tokens, start):
            return runner.execute(
                StepBatch.of(
                    seq_ids=np.zeros(1, dtype=np.int64),
                    start_positions=np.array([start]),
                    query_lens=np.array([len(tokens)]),
                    block_tables=table,
                    input_ids=np.asarray(tokens, dtype=np.int64),
                    logits_lens=np.array([1]),
                )
            )

        out, pos, nxt = [], len(prompt), int(step(prompt, 0)[-1].argmax())
        for _ in range(steps):
            out.append(nxt)
            nxt = int(step([nxt], pos)[-1].argmax())
            pos += 1
        return out


def rel(a, b):
    return float((a - b).norm() / a.norm())


def top1(a, b):
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())


@pytest.fixture(scope="module")
def exact_fp32(v41):
    return teacher_forced(v41, "exact")


def test_mode_selection_and_errors(v41):
    with numerics_mode(None):
        assert numerics.mode() == "exact" and numerics.carrier() is torch.float64
    with numerics_mode("native"):
        assert numerics.native() and numerics.carrier() is torch.float32
        x = torch.randn(3, 5, dtype=torch.float64)
        assert numerics.round_to(x, torch.bfloat16).dtype is torch.float32
    with (
        numerics_mode("fast"),
        pytest.raises(ValueError, match="DEEPINFER_NUMERICS must be one of exact, native, got 'fast'"),
    ):
        numerics.carrier()
    with numerics_mode("native", "1"), pytest.raises(ValueError) as err:
        numerics.carrier()
    assert "DEEPINFER_NUMERICS" in str(err.value) and "DEEPINFER_BATCH_INVARIANT" in str(err.value)
    with numerics_mode("native", "1"), pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT"):
        with_act(v41, torch.float32)  # checked when the model is built, not only at the first step
    with numerics_mode("exact", "1"):  # batch-invariant mode with the exact carrier is fine
        assert numerics.carrier() is torch.float64


def test_native_linear_is_an_act_dtype_gemm_with_cached_weight_copies():
    """BF16 operands, FP32 accumulation, one rounding; the BF16 copy is made once per weight (and once
    per expert stack for per-expert views) and follows in-place updates."""
    torch.manual_seed(0)
    x = torch.randn(7, 64).bfloat16().float()
    stack = torch.randn(3, 16, 64)
    with numerics_mode("native"):
        ref = (x.double() @ stack[1].bfloat16().double().t()).to(torch.bfloat16).float()
        got = numerics.linear(x, stack[1], torch.bfloat16)
        assert got.dtype is torch.float32
        # the GEMM's own FP32 accumulation order may flip a BF16 rounding of the exact sum, rarely
        assert (got != ref).double().mean() < 0.02 and rel(ref.double(), got.double()) < 4e-3
        first = numerics.weight_as(stack[1], torch.bfloat16)
        assert (
            first.untyped_storage().data_ptr()
            == numerics.weight_as(stack[2], torch.bfloat16).untyped_storage().data_ptr()
        )
        assert torch.equal(numerics.weight_as(stack[2], torch.bfloat16), stack[2].bfloat16())
        stack.mul_(2.0)  # e.g. an EPLB shuffle: the cached copy must not be served any more
        assert torch.equal(numerics.weight_as(stack[1], torch.bfloat16), stack[1].bfloat16())
        lg = numerics.logits(x, stack[0], torch.bfloat16)
        assert lg.dtype is torch.float32
        torch.testing.assert_close(
            lg.double(), x.double() @ stack[0].bfloat16().double().t(), rtol=1e-6, atol=1e-5
        )


def test_a_trained_weights_copy_made_without_gradients_is_not_served_to_a_training_forward():
    """Training a drafter runs the frozen model under no_grad on the same trained weights the loss then
    reads with gradients: the cached BF16 copy of the no-grad pass must not cut the gradient off."""
    torch.manual_seed(0)
    x = torch.randn(5, 32).bfloat16().float()
    w = torch.randn(8, 32, requires_grad=True)
    with numerics_mode("native"):
        with torch.no_grad():
            frozen = numerics.linear(x, w, torch.bfloat16)
        numerics.linear(x, w, torch.bfloat16).sum().backward()
        assert w.grad is not None
        # (d sum / d w is the column sum of x, through the BF16 GEMM's backward)
        torch.testing.assert_close(w.grad, x.sum(0).expand(8, 32), rtol=1e-2, atol=1e-2)
        with torch.no_grad():  # the no-grad copy is still cached for no-grad passes
            again = numerics.linear(x, w, torch.bfloat16)
        assert torch.equal(again, frozen)


def test_native_fp32_matches_exact(v41, exact_fp32):
    native = teacher_forced(v41, "native")
    assert torch.isfinite(native).all()
    assert rel(exact_fp32, native) <= FP32_RTOL
    assert top1(exact_fp32, native) == 1.0
    for p in PROMPTS:
        assert greedy(v41, "native", p) == greedy(v41, "exact", p)


def test_native_bf16_within_bf16_noise(v41, exact_fp32):
    model = with_act(v41, torch.bfloat16)
    exact_bf16, native_bf16 = teacher_forced(model, "exact"), teacher_forced(model, "native")
    assert torch.isfinite(native_bf16).all()
    floor_rel, floor_top1 = rel(exact_fp32, exact_bf16), top1(exact_fp32, exact_bf16)
    assert rel(exact_fp32, native_bf16) <= 1.5 * floor_rel, (rel(exact_fp32, native_bf16), floor_rel)
    assert top1(exact_fp32, native_bf16) >= floor_top1 - 0.1
    assert rel(exact_bf16, native_bf16) <= 0.15
    assert top1(exact_bf16, native_bf16) >= 0.85


def _random_schedule(model, rng, n_seqs=3, max_len=40, block=8):
    """Paged runner over a random interleaving of prefill chunks and decodes of `n_seqs` sequences (every
    row's logits) -> (paged rows, stateless rows) per sequence."""
    lens = rng.integers(10, max_len + 1, n_seqs)
    seqs = [rng.integers(4, model.config.vocab_size, n) for n in lens]
    per_seq = -(-max_len // block)
    runner = PagedRunner(model, num_blocks=n_seqs * per_seq, block_size=block)
    tables = [
        np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32)[rng.permutation(per_seq)]
        for i in range(n_seqs)
    ]
    done, got = [0] * n_seqs, [[] for _ in range(n_seqs)]
    while any(d < len(s) for d, s in zip(done, seqs)):
        step = [i for i in range(n_seqs) if done[i] < len(seqs[i]) and rng.random() < 0.8]
        if not step:
            continue
        chunks = [(i, done[i], min(len(seqs[i]), done[i] + int(rng.choice([1, 1, 3, 7, 16])))) for i in step]
        logits = runner.execute(
            StepBatch.of(
                seq_ids=np.array(step),
                start_positions=np.array([lo for _, lo, _ in chunks]),
                query_lens=np.array([hi - lo for _, lo, hi in chunks]),
                block_tables=[tables[i] for i in step],
                input_ids=np.concatenate([seqs[i][lo:hi] for i, lo, hi in chunks]).astype(np.int64),
                logits_lens=np.array([hi - lo for _, lo, hi in chunks]),
            )
        )
        at = 0
        for i, lo, hi in chunks:
            got[i].append(logits[at : at + hi - lo])
            at += hi - lo
            done[i] = hi
    return [
        (torch.cat(g), model.forward(torch.as_tensor(s, device=model.device)).logits)
        for g, s in zip(got, seqs)
    ]


def test_paged_runner_native_matches_stateless_native(v41):
    with numerics_mode("native"):
        pairs = _random_schedule(v41, np.random.default_rng(3))
    for paged, ref in pairs:
        assert paged.dtype is torch.float32
        err = float((paged.double() - ref.double()).abs().max())
        assert err <= PAGED_RTOL * float(ref.abs().max()), err
        assert torch.equal(paged.argmax(-1), ref.argmax(-1))


def test_native_strict_device_run_equals_the_plain_run(v41):
    """Native mode allocates every tensor with an explicit device (strict mode raises otherwise) and
    the strict run gives bitwise the plain native run (same shapes, same kernels)."""
    with numerics_mode("native"):
        plain = _random_schedule(v41, np.random.default_rng(5), n_seqs=2, max_len=24)
        with strict_device():
            strict = _random_schedule(v41, np.random.default_rng(5), n_seqs=2, max_len=24)
            draft = v41.forward(torch.as_tensor(PROMPTS[2], device=v41.device), num_draft_tokens=3).draft
    for (a, b), (c, d) in zip(plain, strict):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert draft.tokens.shape == (3,) and torch.isfinite(draft.logits).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_native_on_cuda_matches_exact_on_cpu(v41, exact_fp32, tmp_path):
    """Whole tiny V4.1 on CUDA under native numerics vs the exact CPU reference: FP32 logits within
    1e-4 relative and equal greedy tokens; BF16 within the BF16 noise floor measured on the CPU."""
    path = make_v41_checkpoint(tmp_path / "ck", seed=0)
    gpu = load_v41(path, device="cuda")
    got = teacher_forced(gpu, "native").cpu()
    assert rel(exact_fp32, got) <= 1e-4 and top1(exact_fp32, got) == 1.0
    for p in PROMPTS:
        assert greedy(gpu, "native", p) == greedy(v41, "exact", p)
    exact_bf16 = teacher_forced(with_act(v41, torch.bfloat16), "exact")
    got_bf16 = teacher_forced(with_act(gpu, torch.bfloat16), "native").cpu()
    assert torch.isfinite(got_bf16).all()
    assert rel(exact_fp32, got_bf16) <= 1.5 * rel(exact_fp32, exact_bf16)
    assert top1(exact_bf16, got_bf16) >= 0.85


# --- native attention products: BF16 operands, FP32 accumulation, FP32 softmax with the sink ---------------

# native vs a float64 reference that rounds P to BF16: measured 5.1e-6 / 3.6e-6 (FP32 sums, and FP32 P
# rounding to the other BF16 neighbour of the FP64 P now and then)
P_ROUNDED_RTOL = 2e-5
P_UNROUNDED_MIN = 1e-4  # native vs the float64 reference without that rounding (measured 1.4e-3..1.6e-3)


def _ref_sink_attention(q, keys, visible, sinks, scale, round_p):
    """float64 sink attention over per-query key sets keys [T, S, D]; P rounded to BF16 if `round_p`."""
    scores = torch.einsum("thd,tsd->ths", q.double(), keys.double()) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    logits = torch.cat((scores, sinks.double()[None, :, None].expand(q.shape[0], -1, 1)), dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    if round_p:
        probs = probs.to(torch.bfloat16).double()
    return torch.einsum("ths,tsd->thd", probs, keys.double())


def _bf16_values(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16().float()


def test_native_sink_attention_and_index_scores_take_bf16_operands():
    """Stateless `sink_attention` (shared and per-query keys) and `index_scores` in native mode with BF16
    activations: equal to float64 math on the BF16 operands with P rounded to BF16 (FP32 sums only), and
    measurably not the unrounded-P result (so the BF16 P.V product is really taken); FP32 activations keep
    FP32 operands (unrounded P); exact mode stays FP64."""
    from deepinfer_model.layers.attention import sink_attention
    from deepinfer_model.layers.indexer import index_scores

    gen = torch.Generator().manual_seed(11)
    t, s, nh, d = 24, 50, 4, 64
    q, keys, sinks = (
        _bf16_values(t, nh, d, gen=gen),
        _bf16_values(s, d, gen=gen),
        torch.randn(nh, generator=gen),
    )
    visible = torch.rand(t, s, generator=gen) < 0.6
    visible[:, 0] = True
    per_query = keys.expand(t, s, d)
    ref_p = _ref_sink_attention(q, per_query, visible, sinks, d**-0.5, True)
    ref_exact = _ref_sink_attention(q, per_query, visible, sinks, d**-0.5, False)
    with numerics_mode("native"):
        for k in (keys, per_query.contiguous()):
            got = sink_attention(q, k, visible, sinks, d**-0.5, torch.bfloat16)
            assert got.dtype is torch.float32
            assert rel(ref_p, got.double()) <= P_ROUNDED_RTOL
            assert rel(ref_exact, got.double()) >= P_UNROUNDED_MIN
        fp32 = sink_attention(q, keys, visible, sinks, d**-0.5, torch.float32)
        assert rel(ref_exact, fp32.double()) <= 1e-6
        qi, ik, hw = (
            _bf16_values(t, 4, 32, gen=gen),
            _bf16_values(s, 32, gen=gen),
            torch.randn(t, 4, generator=gen),
        )
        ref_i = (
            torch.relu(torch.einsum("thd,nd->thn", qi.double(), ik.double())) * hw.double()[..., None]
        ).sum(1)
        got_i = index_scores(qi, ik, hw, False, torch.bfloat16)
        assert got_i.dtype is torch.float32 and rel(ref_i, got_i.double()) <= 1e-6
    with numerics_mode("exact"):
        got = sink_attention(q, keys, visible, sinks, d**-0.5, torch.bfloat16)
        assert got.dtype is torch.float64
        torch.testing.assert_close(got, ref_exact, rtol=1e-12, atol=1e-13)


def test_native_band_attention_takes_bf16_operands():
    """Paged `groups.attend` (window band plus a top-k entry selection, two padded prefill chunks) in native
    BF16 against the float64 full-span reference with P rounded to BF16."""
    from deepinfer_model.layers.indexer import select_topk, selection_mask
    from deepinfer_model.models import grouped_attention as groups
    from deepinfer_model.runtime.metadata import StepMetadata
    from deepinfer_model.runtime.pools import PagedKVCache, PoolSpec

    block, nh, d, window, n_e, topk = 16, 4, 32, 37, 40, 16
    gen = torch.Generator().manual_seed(5)
    starts, qlens = np.array([20, 0]), np.array([150, 140])
    per_seq = -(-int((starts + qlens).max()) // block)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32)[::-1].copy() for i in range(2)]
    batch = StepBatch.of(
        seq_ids=np.arange(2, dtype=np.int64),
        start_positions=starts,
        query_lens=qlens,
        block_tables=tables,
        input_ids=np.zeros(int(qlens.sum()), dtype=np.int64),
        logits_lens=np.ones(2, dtype=np.int64),
    )
    meta = StepMetadata.build(batch, block, num_blocks=2 * per_seq)
    (g,) = groups.make_groups(meta)
    cache = PagedKVCache([PoolSpec("swa.0", block, d)], 2 * per_seq)
    pool = _bf16_values(2 * per_seq * block, d, gen=gen)
    cache.write("swa.0", torch.arange(pool.shape[0]), pool)
    q, sinks = _bf16_values(int(qlens.sum()), nh, d, gen=gen), torch.randn(nh, generator=gen)
    entries = _bf16_values(2, n_e, d, gen=gen)
    entry_vis = torch.rand(2 * g.rows.shape[1], n_e, generator=gen) < 0.5
    selected = select_topk(torch.randn(entry_vis.shape, generator=gen), entry_vis, topk)
    # reference: each real query's full key set (its sequence's tokens 0 .. end-1, then the entries)
    width = int((starts + qlens).max())
    pos = np.minimum(np.arange(width)[None, :], (starts + qlens)[:, None] - 1)
    tok = torch.as_tensor(meta.token_slots_of(np.arange(2)[:, None], pos))
    keys = torch.cat((pool[tok], entries), dim=1)  # [2, width + n_e, D]
    k_pos = torch.arange(width)[None, None, :]
    q_pos = g.q_pos[:, :, None]
    vis = ((k_pos <= q_pos) & (k_pos > q_pos - window)).reshape(-1, width)
    vis = torch.cat((vis, selection_mask(selected, n_e)), dim=1)[g.qmask.reshape(-1)]
    seq_of = torch.arange(2)[:, None].expand(g.rows.shape)[g.qmask]
    q_real = q[g.rows[g.qmask]]
    ref_p = _ref_sink_attention(q_real, keys[seq_of], vis, sinks, d**-0.5, True)
    ref_exact = _ref_sink_attention(q_real, keys[seq_of], vis, sinks, d**-0.5, False)
    with numerics_mode("native"):
        wk = groups.swa_keys(cache, meta, g, "swa.0", window)
        got = groups.attend(q, wk, g, sinks, d**-0.5, meta, (entries, selected), torch.bfloat16)
        got32 = groups.attend(q, wk, g, sinks, d**-0.5, meta, (entries, selected), torch.float32)
    assert got.dtype is torch.float32 and got.shape == ref_p.shape == (int(qlens.sum()), nh, d)
    assert rel(ref_p, got.double()) <= P_ROUNDED_RTOL
    assert rel(ref_exact, got.double()) >= P_UNROUNDED_MIN
    assert rel(ref_exact, got32.double()) <= 1e-6
    # the same attention as one listed-keys call (`listed_attention`, FlashMLA's form on the GPU) through
    # the reference `sparse_prefill_attention`: the same P-rounded result up to its BF16 output rounding
    # (half a BF16 ulp, 2^-8 relative, per element; measured 2.4e-3 in norm), with the YOCO floor too
    from deepinfer_model.backends import cpu as reference

    op = reference.sparse_prefill_attention
    with numerics_mode("native"):
        listed = g.real(groups.listed_attention(op, q, wk, g, sinks, d**-0.5, meta, (entries, selected)))
        floor = np.array([60, 31])
        wf = groups.swa_keys(cache, meta, g, "swa.0", window, floor)
        band_f = groups.attend(q, wf, g, sinks, d**-0.5, meta, (entries, selected), torch.bfloat16)
        listed_f = g.real(groups.listed_attention(op, q, wf, g, sinks, d**-0.5, meta, (entries, selected)))
        no_entries = g.real(groups.listed_attention(op, q, wk, g, sinks, d**-0.5, meta))
        band_only = groups.attend(q, wk, g, sinks, d**-0.5, meta, None, torch.bfloat16)
    assert listed.dtype is torch.bfloat16 and listed.shape == got.shape  # (the kernel's own output rounding)
    assert rel(ref_p, listed.double()) <= 2**-8
    assert rel(band_f.double(), listed_f.double()) <= 2**-8
    assert rel(band_only.double(), no_entries.double()) <= 2**-8
    assert rel(band_f.double(), got.double()) > 1e-2  # (the floor hides keys: a different result)


def test_native_grouped_index_scores_through_the_fused_op(monkeypatch):
    """`groups.grouped_index_scores` in native BF16 as one `index_scores` op call (how a backend kernel
    serves it; here the reference op) against its own torch path and float64 math on the BF16 operands,
    for a padded group of two prefill chunks with their own index keys."""
    from deepinfer_model.backends import cpu as reference
    from deepinfer_model.models import grouped_attention as groups
    from deepinfer_model.models.grouped_attention import index_scores
    from deepinfer_model.runtime.metadata import StepMetadata

    gen = torch.Generator().manual_seed(9)
    qlens, n_i, d_i, n = np.array([37, 42]), 8, 32, 45
    batch = StepBatch.of(
        seq_ids=np.arange(2, dtype=np.int64),
        start_positions=np.array([3, 0]),
        query_lens=qlens,
        block_tables=[np.arange(3, dtype=np.int32), np.arange(3, 6, dtype=np.int32)],
        input_ids=np.zeros(int(qlens.sum()), dtype=np.int64),
        logits_lens=np.ones(2, dtype=np.int64),
    )
    meta = StepMetadata.build(batch, 16, num_blocks=6)
    (g,) = groups.make_groups(meta)
    qi, hw = (
        _bf16_values(int(qlens.sum()), n_i, d_i, gen=gen),
        torch.randn(int(qlens.sum()), n_i, generator=gen),
    )
    keys = _bf16_values(2, n, d_i, gen=gen)
    ref = (torch.relu(torch.einsum("gqhd,gnd->gqhn", qi[g.rows].double(), keys.double()))
           * hw[g.rows].double()[..., None]).sum(2).reshape(-1, n)  # fmt: skip
    with numerics_mode("native"):
        torch_path = groups.grouped_index_scores(qi, keys, hw, g, False, torch.bfloat16)
        calls = []

        def fused(name, x, *shape):
            calls.append((name, shape))
            return reference.index_scores if name == "index_scores" else None

        monkeypatch.setattr(index_scores, "fused_kernel", fused)
        op_path = groups.grouped_index_scores(qi, keys, hw, g, False, torch.bfloat16)
        scaled = groups.grouped_index_scores(qi, keys, hw, g, True, torch.bfloat16)  # (V4's scaled scores)
    assert calls == [("index_scores", (n_i, d_i))]  # the scaled form keeps the torch path
    # the op rounds its FP32 sums to the act dtype itself (native BF16: what `round_narrow` does after the
    # torch path): the same bits as rounding the reference's FP32 output
    assert op_path.shape == torch_path.shape == (g.rows.numel(), n) and op_path.dtype is torch.bfloat16
    assert torch_path.dtype is torch.float32
    fp32 = reference.index_scores(qi[g.rows].bfloat16(), keys.bfloat16(), hw[g.rows]).reshape(-1, n)
    assert torch.equal(op_path, fp32.bfloat16())
    assert rel(ref, fp32.double()) <= 1e-6 and rel(torch_path.double(), fp32.double()) <= 1e-6
    assert rel(ref, op_path.double()) <= 2**-8
    assert rel(ref, scaled.double() * (d_i * n_i) ** 0.5) <= 1e-6


def test_native_grouped_index_scores_with_entry_bounds_select_the_same(monkeypatch):
    """`grouped_index_scores(..., ratio)` through the fused op (the reference op here; the Triton kernel on a
    GPU) passes each query slot's entry bound (p + 1) // ratio: the entries it cannot see come back 0 (the
    kernel skips them), the others as without bounds. Behind the caller's mask (`valid`) the top-k selection
    and the candidate blocks are those of the unbounded scores, for a padded group of two prefill chunks."""
    from deepinfer_model.backends import cpu as reference
    from deepinfer_model.layers.indexer import select_topk
    from deepinfer_model.models import grouped_attention as groups
    from deepinfer_model.models.deepseek_v41.sparse import candidate_blocks
    from deepinfer_model.models.grouped_attention import index_scores
    from deepinfer_model.numerics import round_narrow
    from deepinfer_model.runtime.metadata import StepMetadata

    gen = torch.Generator().manual_seed(11)
    qlens, n_i, d_i, bf16 = np.array([37, 42]), 8, 32, torch.bfloat16
    batch = StepBatch.of(
        seq_ids=np.arange(2, dtype=np.int64),
        start_positions=np.array([60, 0]),
        query_lens=qlens,
        block_tables=[np.arange(8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)],
        input_ids=np.zeros(int(qlens.sum()), dtype=np.int64),
        logits_lens=np.ones(2, dtype=np.int64),
    )
    qi = _bf16_values(int(qlens.sum()), n_i, d_i, gen=gen)
    hw = torch.randn(int(qlens.sum()), n_i, generator=gen)
    calls = []

    def recorded(*args):  # the fused op, recording the bounds it gets
        calls.append(args[3])
        return reference.index_scores(*args)

    monkeypatch.setattr(index_scores, "fused_kernel", lambda name, x, *shape: recorded)
    for ratio in (1, 4):
        meta = StepMetadata.build(batch, 16, num_blocks=16)
        (g,) = groups.make_groups(meta)
        valid = groups.entry_validity(meta, g, ratio)  # what `compressed_entries` gives `_attend_rows`
        n = valid.shape[1]
        keys = _bf16_values(2, n, d_i, gen=gen)
        keys[:, 0] *= 8  # (an entry every query sees that wins its top-k)
        with numerics_mode("native"):
            full = round_narrow(groups.grouped_index_scores(qi, keys, hw, g, False, bf16), bf16)
            bounded = groups.grouped_index_scores(qi, keys, hw, g, False, bf16, ratio)
            assert bounded.dtype is bf16 and round_narrow(bounded, bf16) is bounded  # (no rounding left)
            assert calls[-2] is None and torch.equal(calls[-1], (g.q_pos + 1) // ratio)
            assert torch.equal(bounded, full.masked_fill(~valid, 0.0))
            assert bool((bounded[~valid] == 0).all()) and not bool((full[~valid] == 0).all())
            for k in (4, n):
                assert torch.equal(select_topk(bounded, valid, k), select_topk(full, valid, k))
            assert torch.equal(candidate_blocks(bounded, valid, 4, 3), candidate_blocks(full, valid, 4, 3))


def test_paged_runner_native_bf16_matches_stateless_native_bf16(v41):
    """Both sides take BF16 attention / indexer operands, so they differ only in FP32 summation order; a
    BF16 rounding flip then propagates (through the indexer's top-k, too) and can move a row by up to a few
    percent of its largest logit (measured: 2.6e-2 on one of these rows, <= 2e-7 on the others)."""
    model = with_act(v41, torch.bfloat16)
    with numerics_mode("native"):
        pairs = _random_schedule(model, np.random.default_rng(4))
    for paged, ref in pairs:
        assert paged.dtype is torch.float32
        assert (
            rel(ref.double(), paged.double()) <= 0.02
        )  # measured <= 6.0e-3 (well below the 0.14 BF16 floor)
        assert top1(ref, paged) == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_native_bf16_attention_products_on_cuda_accumulate_in_fp32():
    """CUDA: `bmm_f32` on BF16 operands returns FP32 sums (not BF16-rounded ones), and native BF16
    `sink_attention` on the GPU equals the CPU's (same BF16 operands and rounded P; FP32 sums only)."""
    from deepinfer_model.layers.attention import sink_attention

    gen = torch.Generator().manual_seed(3)
    a, b = _bf16_values(6, 40, 256, gen=gen), _bf16_values(6, 256, 30, gen=gen)
    ref = a.double() @ b.double()
    got = numerics.bmm_f32(a.cuda().bfloat16(), b.cuda().bfloat16())
    assert got.dtype is torch.float32
    assert rel(ref, got.cpu().double()) <= 1e-6  # a BF16 output would be ~2e-3 off
    t, s, nh, d = 64, 300, 8, 128
    q, keys, sinks = (
        _bf16_values(t, nh, d, gen=gen),
        _bf16_values(s, d, gen=gen),
        torch.randn(nh, generator=gen),
    )
    visible = torch.rand(t, s, generator=gen) < 0.5
    visible[:, 0] = True
    with numerics_mode("native"):
        cpu = sink_attention(q, keys, visible, sinks, d**-0.5, torch.bfloat16)
        gpu = sink_attention(q.cuda(), keys.cuda(), visible.cuda(), sinks.cuda(), d**-0.5, torch.bfloat16)
    assert gpu.dtype is torch.float32
    assert rel(cpu.double(), gpu.cpu().double()) <= P_ROUNDED_RTOL


def test_narrow_values_equal_the_widened_ones_and_sort_the_same():
    """`round_narrow` (native, BF16 activations) hands out the BF16 tensor whose values `round_to` widens;
    `select_topk` of such 16-bit scores picks exactly what it picks from the widened scores: the same order
    and the same ties (many equal BF16 values, lower index first), a naive stable ranking in float64 as the
    oracle. Exact mode and FP32 activations keep the carrier."""
    from deepinfer_model.layers.indexer import select_topk
    from deepinfer_model.numerics import narrow_act, round_narrow, round_to

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 300, generator=gen) * 4
    x[:, ::3] = torch.randint(-8, 8, (37, 100), generator=gen) * 0.5  # many exact ties
    valid = torch.rand(37, 300, generator=gen) < 0.8
    with numerics_mode("native"):
        assert narrow_act(torch.bfloat16) and not narrow_act(torch.float32)
        narrow, wide = round_narrow(x, torch.bfloat16), round_to(x, torch.bfloat16)
        assert narrow.dtype is torch.bfloat16 and wide.dtype is torch.float32
        assert torch.equal(narrow.float(), wide)
        assert round_narrow(x, torch.float32).dtype is torch.float32
        picked, picked_wide = select_topk(narrow, valid, 64), select_topk(wide, valid, 64)
    assert torch.equal(picked, picked_wide)
    assert sum(300 - len(set(r.tolist())) for r in narrow.float()) > 1000  # (ties do occur)
    for row in range(x.shape[0]):  # oracle: best valid scores, ties to the lower index, then ascending
        cand = [j for j in range(300) if valid[row, j]]
        ranked = sorted(cand, key=lambda j: (-float(wide[row, j]), j))[:64]
        want = sorted(ranked) + [-1] * (64 - len(ranked))
        assert picked[row].tolist() == want
    with numerics_mode("exact"):
        assert not narrow_act(torch.bfloat16)
        assert round_narrow(x, torch.bfloat16).dtype is torch.float64


def test_native_shared_expert_keeps_bf16_projections_with_the_widened_values():
    """The shared expert in native BF16 (projections and output left in BF16, the registry's `swiglu` rounding
    h once) gives bit for bit what widening both projections to FP32, the SwiGLU in FP32 and the down projection's
    rounding of h gave; the SwiGLU op itself against a float64 oracle; FP32 activations keep the widened
    path."""
    from deepinfer_model.layers.experts import MLPWeights, clamped_swiglu, mlp
    from deepinfer_model.ops import get_ops

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(33, 64, generator=gen) * 2).bfloat16().float()
    w = MLPWeights(*(torch.randn(s, generator=gen) * 0.3 for s in ((96, 64), (96, 64), (64, 96))))
    with numerics_mode("native"):
        gate, up = (numerics.linear(x, m, torch.bfloat16) for m in (w.w1, w.w3))
        widened = numerics.linear(clamped_swiglu(gate, up, 1.75), w.w2, torch.bfloat16)
        got = mlp(x, w, 1.75, torch.bfloat16)
        assert got.dtype is torch.bfloat16 and torch.equal(got.float(), widened)
        assert torch.equal(mlp(x, w, 1.75, torch.float32), mlp(x.double(), w, 1.75, torch.float32))
    g, u = gate.double().clamp(max=1.75), up.double().clamp(-1.75, 1.75)
    oracle = (g / (1 + torch.exp(-g)) * u).to(torch.bfloat16)
    h = get_ops("cpu").swiglu(gate.bfloat16(), up.bfloat16(), 1.75)
    assert h.dtype is torch.bfloat16
    assert (h != oracle).double().mean() < 0.02  # (FP32 math vs FP64: a rare rounding flip)
    torch.testing.assert_close(h.double(), oracle.double(), rtol=8e-3, atol=1e-6)


def test_steps_on_two_threads_pin_their_own_settings_and_leave_none_behind(monkeypatch):
    """A model step on one thread (the async loop's model thread) and one on another (the host thread)
    overlap: each keeps the settings it read at its start, and once both end, nothing stays pinned (a
    process-wide pin, saved and restored by interleaved blocks, outlived both and served every later
    call of the process the first step's mode)."""
    import threading

    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with numerics.resolved():
            first_in.set()
            second_in.wait(10)
            seen["first"] = numerics.mode()
        first_out.set()

    def second():
        first_in.wait(10)
        os.environ["DEEPINFER_NUMERICS"] = "exact"  # (restored by monkeypatch)
        with numerics.resolved():
            second_in.set()
            first_out.wait(10)
            seen["second"] = numerics.mode()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"first": "native", "second": "exact"}
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    assert numerics.native() and numerics.carrier() is torch.float32  # read afresh: nothing pinned
