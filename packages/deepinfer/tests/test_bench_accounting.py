"""Benchmark accounting formulas against hand-computed values."""

import pytest
from deepinfer.bench import (
    Interval,
    decode_full_acceptance_per_gpu,
    decode_full_acceptance_per_user,
    decode_measured_per_gpu,
    decode_measured_per_user,
    prefill_tok_per_s_per_gpu,
    summarize,
)


def test_decode_full_acceptance_is_steps_times_batch_times_1_plus_nextn_over_cp():
    # 20 steps/s, batch 64, nextn 1: 20 * 64 * 2 = 2560 tokens/s/GPU
    assert decode_full_acceptance_per_gpu(20.0, 64, 1) == pytest.approx(2560.0)
    # cp = 2: the two ranks share the sequences' tokens -> 1280
    assert decode_full_acceptance_per_gpu(20.0, 64, 1, cp=2) == pytest.approx(1280.0)
    # dp = 2 with a global batch of 64: 32 per rank -> 20 * 32 * 2 = 1280
    assert decode_full_acceptance_per_gpu(20.0, 64, 1, dp=2) == pytest.approx(1280.0)
    # nextn = 0 is plain decoding: steps/s * batch
    assert decode_full_acceptance_per_gpu(12.5, 8, 0) == pytest.approx(100.0)
    assert decode_full_acceptance_per_user(20.0, 3) == pytest.approx(80.0)


def test_measured_accounting_counts_emitted_tokens():
    assert decode_measured_per_gpu(3000, 1.5, cp=2) == pytest.approx(1000.0)
    assert decode_measured_per_user(600, 2.0, 3) == pytest.approx(100.0)
    assert prefill_tok_per_s_per_gpu(8192, 0.5, cp=2) == pytest.approx(8192.0)
    assert prefill_tok_per_s_per_gpu(8192, 0.5, dp=4) == pytest.approx(4096.0)


def test_full_vs_measured_on_a_window_with_partial_acceptance():
    # batch 8, nextn 2, 4 steps of 0.1 s; per step 8 requests emit 1 + accepted drafts:
    # accepted per step = 8, 4, 16, 0 -> emitted 16, 12, 24, 8 = 60 tokens in 0.4 s
    w = summarize([Interval(0.1, 8 + a, batch=8) for a in (8, 4, 16, 0)])
    assert w.steps_per_s == pytest.approx(10.0)
    full = decode_full_acceptance_per_gpu(w.steps_per_s, 8, 2)
    measured = decode_measured_per_gpu(w.tokens, w.seconds)
    assert full == pytest.approx(240.0)  # 10 * 8 * 3: as if all 16 drafts per step were accepted
    assert measured == pytest.approx(150.0)  # 60 / 0.4
    assert measured < full


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: decode_full_acceptance_per_gpu(1.0, 1, -1), "nextn"),
        (lambda: decode_full_acceptance_per_gpu(1.0, 1, 0, cp=0), "cp"),
        (lambda: decode_measured_per_gpu(1, 0.0), "seconds"),
        (lambda: decode_measured_per_user(1, 1.0, 0), "batch"),
        (lambda: prefill_tok_per_s_per_gpu(10, 1.0, dp=0), "dp"),
        (lambda: prefill_tok_per_s_per_gpu(-1, 1.0), "non_cached_tokens"),
    ],
)
def test_bad_accounting_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()
