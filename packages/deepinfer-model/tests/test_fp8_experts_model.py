"""`DEEPINFER_FP8_EXPERTS=1` on the CPU: the tiny V4.1 loads its MXFP4 routed experts as 128x128-block
FP8 (`quant_sm90.Fp8Experts`) and `experts_forward` runs them through the `grouped_expert_mlp` op, with
the FP8 activation steps a Hopper GPU applies, so a GPU run can be compared with a CPU run of the same
numerics. Unset (or 0), the model is bitwise the default one.

References: a float64 loop over (token, slot) pairs written from the op's definition (Q8 in 1x128
groups with power-of-two scales, BF16 GEMM outputs), on the default load's dequantised MXFP4 weights
(so the load-time conversion is checked too); the stateless forward for the paged runner.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_model.layers import ExpertWeights, experts_forward
from deepinfer_model.layers.moe import MoEWeights
from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint
from deepinfer_model.quant_sm90 import ENV, Fp8Experts
from deepinfer_model.runner import StepBatch
from deepinfer_model.runtime import PagedRunner

TOKENS = torch.tensor([5, 17, 99, 3, 250, 41, 8, 8, 77, 120, 64, 33, 200, 9, 18, 141, 7, 92, 240, 4])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_v41_checkpoint(tmp_path_factory.mktemp("v41-fp8-experts"), seed=0)


@pytest.fixture(scope="module")
def models(ckpt):
    """(default load, DEEPINFER_FP8_EXPERTS=1 load) of the same checkpoint. The variable is read at load."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENV, raising=False)
        mp.delenv("DEEPINFER_NUMERICS", raising=False)
        default = load_v41(ckpt)
        mp.setenv(ENV, "1")
        fp8 = load_v41(ckpt)
    return default, fp8


def _moes(model) -> list[MoEWeights]:
    out = [b.moe for b in model.weights.layers if isinstance(getattr(b, "moe", None), MoEWeights)]
    drafter = model.weights.drafter
    if drafter is not None:
        out += [b.moe for b in drafter.blocks if isinstance(getattr(b, "moe", None), MoEWeights)]
    return out


def test_loads_routed_experts_as_fp8_blocks(models):
    default, fp8 = models
    moes, ref = _moes(fp8), _moes(default)
    assert len(moes) == len(ref) > 0
    for m, r in zip(moes, ref, strict=True):
        assert isinstance(r.experts, ExpertWeights) and isinstance(m.experts, Fp8Experts)
        e, i, h = r.experts.w1.shape
        i_pad = -(-i // 128) * 128  # the tiny I = 64 is zero-padded to one 128 block
        assert m.experts.w13.shape == (e, 2 * i_pad, h) and m.experts.w13.dtype == torch.float8_e4m3fn
        assert m.experts.w2.shape == (e, h, i_pad) and m.experts.s2.shape == (e, h // 128, i_pad // 128)
        assert m.shared is r.shared or torch.equal(m.shared.w1, r.shared.w1)  # shared expert untouched


def _q8(v: torch.Tensor) -> torch.Tensor:
    """FP8-E4M3 quantise->dequantise of a 1-D FP64 vector in 1x128 groups, power-of-two group scales
    (smallest 2^b with amax / 2^b <= 448), written from the definition."""
    out = torch.empty_like(v)
    for lo in range(0, v.numel(), 128):
        g = v[lo : lo + 128].float()
        amax = float(g.abs().max())
        b = int(np.ceil(np.log2(max(amax, 1e-4) / 448.0)))
        s = 2.0**b
        out[lo : lo + 128] = (g / s).to(torch.float8_e4m3fn).double() * s
    return out


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).double()


def _swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g = g.clamp(max=limit)
    return g / (1.0 + torch.exp(-g)) * u.clamp(-limit, limit)


def _reference(x, weights, ids, ex: ExpertWeights, shared, limit, act, weight_before_down):
    """FP64, one (token, slot) pair at a time; the op's rounding points, then shared expert + one rounding."""
    w1, w3, w2 = (t.double() for t in (ex.w1, ex.w3, ex.w2))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xq = _q8(x[t])
        routed = torch.zeros(x.shape[1], dtype=torch.float64)
        for s in range(ids.shape[1]):
            e, w = int(ids[t, s]), float(weights[t, s])
            h = _swiglu(_bf16(w1[e] @ xq), _bf16(w3[e] @ xq), limit)
            if weight_before_down:
                routed += _bf16(w2[e] @ _q8(h.float().double() * w))
            else:
                routed += (_bf16(w2[e] @ _q8(h.float().double())) * w).float().double()
        routed = routed.float().double()  # the op's FP32 sum over slots
        r = lambda v: v.to(act).double()  # noqa: E731
        sh = r(
            shared.w2.double() @ _swiglu(r(shared.w1.double() @ x[t]), r(shared.w3.double() @ x[t]), limit)
        )
        out[t] = r(routed + sh)
    return out


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_before_down", [True, False])
def test_fp8_experts_forward_matches_float64_pair_loop(models, act, weight_before_down):
    default, fp8 = models
    m, ref_m = _moes(fp8)[0], _moes(default)[0]
    e, _, h = ref_m.experts.w1.shape
    gen = torch.Generator().manual_seed(5)
    t, k, limit = 11, 3, fp8.config.swiglu_limit
    x = (torch.randn(t, h, generator=gen) * 2).to(act).double()  # act-dtype values in the FP64 carrier
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) + 0.2
    got = experts_forward(x, weights, ids, m.experts, m.shared, limit, act, weight_before_down)
    ref = _reference(x, weights, ids, ref_m.experts, ref_m.shared, limit, act, weight_before_down)
    assert got.dtype == torch.float64 and bool(torch.isfinite(got).all())
    rel = float((got - ref).norm() / ref.norm())
    # the op's own CPU test bound (test_quant_sm90_moe: rel < 1e-6); GEMM vs matrix-vector FP64 sums
    # may flip a BF16 rounding of a GEMM output now and then
    assert rel < 1e-6, rel
    assert (got == ref).double().mean() > 0.95
    # not the default numerics: the Q8 casts move the result
    plain = experts_forward(x, weights, ids, ref_m.experts, ref_m.shared, limit, act, weight_before_down)
    assert float((plain - got).norm() / plain.norm()) > 1e-3


def test_logits_differ_from_default_by_the_fp8_steps_and_stay_finite(models):
    default, fp8 = models
    l0, l1 = default.forward(TOKENS).logits, fp8.forward(TOKENS).logits
    assert bool(torch.isfinite(l1).all())
    rel = float((l1 - l0).norm() / l0.norm())
    assert 0.05 < rel < 0.6, rel  # measured 0.26 on this checkpoint (24-34% on the medium model)


def test_paged_runner_bitwise_equal_to_stateless_forward(models):
    """Chunked prefill of two interleaved sequences, then decode steps, blocks out of order: every row
    equals the stateless forward bitwise (the op is per-row: per-token Q8, FP64 GEMMs rounded once)."""
    _, model = models
    seqs = [TOKENS.tolist(), [(13 * j + 7) % 256 for j in range(15)]]
    refs = [model.forward(torch.tensor(s)).logits for s in seqs]
    block = 4
    runner = PagedRunner(model, num_blocks=16, block_size=block)
    tables = [np.array([9, 2, 14, 0, 5, 11]), np.array([3, 15, 7, 1])]
    # (seq, start, length) steps: prefill chunks of both sequences in one batch, then decodes
    steps = [[(0, 0, 7), (1, 0, 5)], [(1, 5, 6), (0, 7, 6)], [(0, 13, 1), (1, 11, 1)]]
    steps += [[(0, p, 1), (1, 12 + p - 14, 1)] for p in range(14, 17)] + [[(0, 17, 3)]]
    n_rows = 0
    for step in steps:
        batch = StepBatch.of(
            seq_ids=np.array([s for s, _, _ in step]),
            start_positions=np.array([p for _, p, _ in step]),
            query_lens=np.array([q for _, _, q in step]),
            block_tables=[tables[s].astype(np.int32) for s, _, _ in step],
            input_ids=np.concatenate([seqs[s][p : p + q] for s, p, q in step]),
            logits_lens=np.array([q for _, _, q in step]),
        )
        got = runner.execute(batch)
        row = 0
        for s, p, q in step:
            assert torch.equal(got[row : row + q], refs[s][p : p + q]), (s, p, q)
            row += q
            n_rows += q
    assert n_rows == len(seqs[0]) + len(seqs[1])


def test_unset_or_zero_is_the_default_model_bitwise(ckpt, models, monkeypatch):
    default, _ = models
    monkeypatch.setenv(ENV, "0")
    zero = load_v41(ckpt)
    assert all(isinstance(m.experts, ExpertWeights) for m in _moes(zero))
    assert torch.equal(zero.forward(TOKENS).logits, default.forward(TOKENS).logits)


def test_bad_value_and_expert_parallelism_are_refused(ckpt, monkeypatch):
    from deepinfer_model.parallel.ep_moe import ExpertParallelMoE

    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match="DEEPINFER_FP8_EXPERTS must be 0 or 1, got 'yes'"):
        load_v41(ckpt)
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(
        ValueError, match="DEEPINFER_FP8_EXPERTS=1 cannot be combined with expert parallelism"
    ):
        ExpertParallelMoE(None, None)  # refused before the config, layout or process group is read


def test_engine_greedy_generation(ckpt, monkeypatch):
    """Greedy decoding through the engine (paged cache, BF16 activations, cache-format KV) emits the
    tokens the stateless forward of the engine's own (FP8-experts) model picks, teacher-forced."""
    pytest.importorskip("deepinfer")
    from deepinfer import SamplingParams
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine_args import EngineArgs

    monkeypatch.setenv(ENV, "1")
    engine = LLMEngine(EngineArgs(model=str(ckpt), max_model_len=48, block_size=16), num_speculative_tokens=0)
    prompts = [TOKENS[:9].tolist(), [(11 * j + 5) % 256 for j in range(13)]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for j, p in enumerate(prompts):
        engine.add_request(str(j), None, params, prompt_token_ids=p)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    engine.close()
    model = engine.model
    assert all(isinstance(m.experts, Fp8Experts) for m in _moes(model))
    for j, p in enumerate(prompts):
        gen = outs[str(j)].outputs[0].token_ids
        assert len(gen) == 6
        logits = model.forward(torch.tensor(p + gen[:-1])).logits[-len(gen) :]
        assert bool(torch.isfinite(logits).all())
        assert logits.argmax(-1).tolist() == list(gen)
