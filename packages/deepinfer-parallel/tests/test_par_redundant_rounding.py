"""DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS: a lower bound rounded up so routed + redundant divides EP."""

from __future__ import annotations

import logging

import pytest
from deepinfer_parallel import num_redundant_experts, resolve_redundant_experts

ENV = "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"


@pytest.mark.parametrize(
    ("n_routed", "ep", "minimum", "expected"),
    [
        (384, 8, 32, 32),  # 416 = 52 * 8
        (384, 16, 32, 32),
        (384, 64, 32, 64),  # 416 -> 448 = 7 * 64
        (256, 48, 0, 32),  # 288 = 6 * 48
        (256, 1, 5, 5),
        (10, 4, 3, 6),  # 13 -> 16
    ],
)
def test_rounding_rule(n_routed, ep, minimum, expected):
    extra = num_redundant_experts(n_routed, ep, minimum)
    assert extra == expected
    # The smallest such count: no value in [minimum, extra) works.
    assert (n_routed + extra) % ep == 0
    assert all((n_routed + m) % ep for m in range(minimum, extra))


def test_default_is_32_and_env_overrides(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert num_redundant_experts(384, 8) == 32
    monkeypatch.setenv(ENV, "40")
    assert num_redundant_experts(384, 8) == 40
    monkeypatch.setenv(ENV, "41")
    assert num_redundant_experts(384, 8) == 48


def test_log_line_only_when_rounded(caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer_parallel.redundant"):
        num_redundant_experts(384, 8, 32)
        assert not caplog.records
        num_redundant_experts(384, 64, 32, which="drafter")
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "drafter" in msg and "32 to 64" in msg and "ep_size=64" in msg


def test_backbone_and_drafter_rounded_separately(monkeypatch):
    monkeypatch.setenv(ENV, "32")
    out = resolve_redundant_experts(384, 24, drafter_routed=72)
    assert out == {"backbone": 48, "drafter": 48}  # 432 = 18*24 ; 120 = 5*24
    out = resolve_redundant_experts(384, 64, drafter_routed=96)
    assert out == {"backbone": 64, "drafter": 32}  # 448 = 7*64 ; 128 = 2*64


def test_bad_values(monkeypatch):
    monkeypatch.setenv(ENV, "many")
    with pytest.raises(ValueError, match="DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS must be an integer >= 0"):
        num_redundant_experts(384, 8)
    monkeypatch.setenv(ENV, "-1")
    with pytest.raises(ValueError, match="DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"):
        num_redundant_experts(384, 8)
    with pytest.raises(ValueError, match="ep_size must be an integer >= 1, got 0"):
        num_redundant_experts(384, 0, 32)
