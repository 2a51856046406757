"""DSpark drafter: Markov correction, confidence head and main keys against float64 re-derivations, and the
draft block's window / sequential-Markov behaviour on the §11 tiny config (random in-memory weights)."""

import math

import pytest
import torch
from deepinfer_model.models.deepseek_v41 import (
    DeepseekV41Config,
    DeepseekV41ForCausalLM,
    V41Weights,
    random_v41_tensors,
    tiny_v41_config_dict,
)
from deepinfer_model.models.deepseek_v41.drafter import draft_block
from deepinfer_model.models.deepseek_v41.drafter_heads import (
    MarkovHead,
    confidence,
    confidence_temperatures,
    markov_correction,
)
from deepinfer_model.models.deepseek_v41.engram_vocab import CompressedVocabulary


def test_markov_and_confidence_heads_match_float64():
    g = torch.Generator().manual_seed(0)
    v, r, h = 11, 4, 6
    mk = MarkovHead(torch.randn(v, r, generator=g), torch.randn(v, r, generator=g))
    logits, prev = torch.randn(3, v, generator=g), torch.tensor([2, 7, 7])
    hidden, proj = torch.randn(3, h, generator=g), torch.randn(1, h + r, generator=g) * 3
    got, e = markov_correction(logits, prev, mk)
    temps = torch.tensor([1.0, 0.5, 1e-9])
    conf = confidence(hidden, e, proj, temps)
    for s in range(3):
        emb = mk.embed[prev[s]].double()
        torch.testing.assert_close(got[s].double(), logits[s].double() + mk.head.double() @ emb)
        z = float(proj[0].double() @ torch.cat((hidden[s].double(), emb))) / max(float(temps[s]), 1e-5)
        want = 1 / (1 + math.exp(-min(max(z, -60.0), 60.0)))
        assert abs(float(conf[s]) - want) < 1e-6


def test_confidence_temperature_env(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "2.0")
    assert confidence_temperatures(3).tolist() == [2.0, 2.0, 2.0]
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "1,0,3")
    assert confidence_temperatures(3).tolist() == pytest.approx([1.0, 1e-5, 3.0])
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", "1,2")
    with pytest.raises(ValueError, match="exactly 3"):
        confidence_temperatures(3)


@pytest.fixture(scope="module")
def model():
    cfg = DeepseekV41Config.from_dict(tiny_v41_config_dict())
    w = V41Weights.from_tensors(cfg, random_v41_tensors(cfg, seed=3).__getitem__)
    return DeepseekV41ForCausalLM(cfg, w, CompressedVocabulary(torch.arange(256) % 200, 200, 2))


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_main_keys_and_sequential_markov(model):
    w = model.weights
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(5))
    out = model.forward(ids, num_draft_tokens=4, next_token=17)
    d = w.drafter
    # main keys: RMSNorm(main_proj · F), then each block's own wkv / kv_norm and plain RoPE at the token position
    m = _rms(out.features.double() @ d.main_proj.double().t(), d.main_norm.double())
    k0 = _rms(m @ d.blocks[1].attn.wkv.double().t(), d.blocks[1].attn.kv_norm.double())
    torch.testing.assert_close(
        out.main_keys[1, 0].double(), k0[0], rtol=1e-5, atol=1e-5
    )  # position 0: no rotation
    torch.testing.assert_close(
        out.main_keys[1, :, :64].double(), k0[:, :64], rtol=1e-5, atol=1e-5
    )  # nope part
    # heads: base logits from the drafter's final norm + shared LM head, Markov term on the previous token
    dr = out.draft
    assert dr.positions.tolist() == [30, 31, 32, 33] and dr.tokens.tolist() == dr.logits.argmax(-1).tolist()
    base = _rms(dr.hidden.double(), d.norm.double()) @ w.head.double().t()
    prev = [17] + dr.tokens.tolist()[:-1]
    for s in range(4):
        want = base[s] + d.markov.head.double() @ d.markov.embed[prev[s]].double()
        torch.testing.assert_close(dr.logits[s].double(), want, rtol=1e-5, atol=1e-4)
        z = float(
            d.confidence_proj[0].double()
            @ torch.cat((dr.hidden[s].double(), d.markov.embed[prev[s]].double()))
        )
        assert abs(float(dr.confidence[s]) - 1 / (1 + math.exp(-z))) < 1e-5


def test_draft_sees_only_the_last_window_of_main_keys(model):
    cfg, w = model.config, model.weights
    keys = torch.randn(2, 40, cfg.head_dim, generator=torch.Generator().manual_seed(6))
    a, W = 39, cfg.sliding_window

    def run(k):
        return draft_block(cfg, w.drafter, w.embed, w.head, k, 5, a, 4).logits

    ref = run(keys)
    older = keys.clone()
    older[:, : a - W + 1] += 1.0  # outside the window: no effect
    assert torch.equal(run(older), ref)
    inside = keys.clone()
    inside[:, a - W + 1] += 1.0
    assert not torch.allclose(run(inside), ref)


def test_draft_argument_errors(model):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        model.forward([1, 2, 3], num_draft_tokens=33)
    with pytest.raises(ValueError, match="next_token"):
        model.forward([1, 2, 3], num_draft_tokens=2, next_token=999)
