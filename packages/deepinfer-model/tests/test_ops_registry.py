"""The op registry on the CPU: backend selection, fallbacks, and the CPU entries against naive references."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from deepinfer_model.ops import (
    OP_SPECS,
    get_ops,
    pack_fp8_tokens,
    register,
    resolve_backend,
    unpack_fp8_tokens,
)
from deepinfer_model.ops import registry as reg
from deepinfer_model.ops.kv_format import store_fp8_tokens
from deepinfer_model.quant import fake_quant_fp8, quant_fp8_block


def test_env_selects_cpu(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    assert resolve_backend() == "cpu"
    assert get_ops().backend == "cpu"


@pytest.mark.parametrize("value", ["cuda", "gpu", "tpu"])
def test_unknown_accelerator_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", value)
    with pytest.raises(ValueError, match="DEEPINFER_ACCELERATOR must be one of"):
        resolve_backend()


def test_ascend_is_reserved(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with pytest.raises(ValueError, match="reserved"):
        resolve_backend()


def test_explicit_nvidia_without_cuda_raises(monkeypatch):
    monkeypatch.setattr(reg, "_cuda_available", lambda: False)
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        resolve_backend()


def test_nvidia_build_without_cuda_falls_back_with_a_log_line(monkeypatch, caplog):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    monkeypatch.setattr(reg, "_cuda_available", lambda: False)
    monkeypatch.setattr(reg, "_build_accelerator", lambda: "nvidia")
    with caplog.at_level(logging.WARNING, logger="deepinfer_model.ops"):
        assert resolve_backend() == "cpu"
    assert "no CUDA device" in caplog.text


def test_cpu_table_covers_every_op():
    table = get_ops("cpu")
    assert set(table.sources) == set(OP_SPECS)
    assert set(table.sources.values()) == {"cpu"}
    with pytest.raises(AttributeError, match="not implemented"):
        _ = table.no_such_op


def test_register_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown op"):
        register("cpu", "no_such_op")
    with pytest.raises(ValueError, match="backend must be one of"):
        register("tpu", "rms_norm")


def test_kv_pack_matches_fake_quant_and_layout():
    x = torch.randn(37, 512) * torch.logspace(-3, 2, 37)[:, None]
    packed = pack_fp8_tokens(x)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 528)
    torch.testing.assert_close(unpack_fp8_tokens(packed), fake_quant_fp8(x, 32), rtol=0, atol=0)
    # scales are UE8M0 bytes after the data: byte 512 + g holds the exponent of group g
    amax = x[:, :32].abs().amax(-1)
    assert bool(((2.0 ** (packed[:, 512].float() - 127)) * 448 >= amax).all())


def test_kv_store_writes_only_its_slots_and_validates():
    cache = torch.zeros(3, 4, 1, 528, dtype=torch.uint8)
    lat = torch.randn(2, 512)
    store_fp8_tokens(lat, cache, torch.tensor([5, 11]))
    flat = cache.view(12, 528)
    torch.testing.assert_close(unpack_fp8_tokens(flat[[5, 11]]), fake_quant_fp8(lat, 32), rtol=0, atol=0)
    assert int(flat[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10]].count_nonzero()) == 0
    with pytest.raises(ValueError, match="slots must lie in"):
        store_fp8_tokens(lat, cache, torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="latent must be"):
        store_fp8_tokens(torch.randn(2, 64), cache, torch.tensor([0, 1]))


def test_cpu_fp8_block_linear_close_to_exact_product():
    torch.manual_seed(0)
    x = torch.randn(9, 256).to(torch.bfloat16)
    w, s = quant_fp8_block(torch.randn(384, 256) * 0.05, (128, 128))
    out = get_ops("cpu").fp8_block_linear(x, w, s.float() if s.dtype != torch.float8_e8m0fnu else s)
    wd = w.double() * (2.0 ** (s.view(torch.uint8).double() - 127)).repeat_interleave(
        128, 0
    ).repeat_interleave(128, 1)
    exact = x.double() @ wd.t()
    assert out.dtype == torch.bfloat16 and out.shape == (9, 384)
    rel = (out.double() - exact).norm() / exact.norm()
    assert rel < 3e-2  # activation FP8 quantisation noise only (weights are exactly dequantised)


def _naive_sink_decode(q, keys_by_row, sinks, scale):
    b, h, d = q.shape
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        k = keys_by_row[i]
        for j in range(h):
            if k.shape[0] == 0:
                continue
            s = (k @ q[i, j].double()) * scale
            m = max(float(s.max()), float(sinks[j]))
            e = torch.exp(s - m)
            out[i, j] = (e[:, None] * k).sum(0) / (e.sum() + math.exp(float(sinks[j]) - m))
    return out


def test_cpu_sparse_decode_matches_naive_loop():
    torch.manual_seed(1)
    blocks, page, b, h, k = 4, 16, 3, 4, 8
    lat = torch.randn(blocks * page, 512)
    cache = torch.zeros(blocks, page, 1, 528, dtype=torch.uint8)
    store_fp8_tokens(lat, cache, torch.arange(blocks * page))
    idx = torch.randint(0, blocks * page, (b, k), dtype=torch.int32)
    idx[1, 5:] = -1
    idx[2, :] = -1  # a query with no key returns zeros
    q = torch.randn(b, h, 512).to(torch.bfloat16)
    sinks = torch.randn(h)
    out = get_ops("cpu").sparse_decode_attention(q, cache, idx, sinks, 512**-0.5)
    deq = fake_quant_fp8(lat, 32).double()
    rows = [deq[idx[i][idx[i] >= 0].long()] for i in range(b)]
    ref = _naive_sink_decode(q, rows, sinks, 512**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    assert int(out[2].count_nonzero()) == 0
