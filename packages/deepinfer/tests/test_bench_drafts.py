"""Drafted against plain decoding in the benchmarks: the window's acceptance keys from the engine's
counts, the comparison keys, and `deepinfer bench throughput` running a drafted engine and a plain one
on the same workload in one run (tiny V4.1, CPU)."""

import json

import numpy as np
import pytest
from deepinfer.bench.drafts import SpecSnapshot, compare_to_plain, spec_keys
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint


def test_window_acceptance_is_the_difference_of_two_snapshots():
    before = SpecSnapshot(3, np.array([4, 4, 2]), np.array([2, 1, 0]), 4, 2, 0.5)
    after = SpecSnapshot(3, np.array([10, 9, 5]), np.array([6, 3, 1]), 10, 5, 0.8)
    keys = spec_keys(before, after)
    assert keys["drafts_on"] and keys["nextn"] == 3 and keys["drafted_steps"] == 3
    assert [keys[f"verified_drafts_pos{j}"] for j in (1, 2, 3)] == [6, 5, 3]
    assert [keys[f"accept_rate_pos{j}"] for j in (1, 2, 3)] == [4 / 6, 2 / 5, 1 / 3]
    assert keys["mean_accepted_len_tokens"] == 7 / 6  # accepted drafts per request-step
    assert keys["mean_verified_len_tokens"] == 14 / 6
    assert keys["emitted_tokens_per_request_step"] == 1 + 7 / 6
    assert keys["draft_host_ms_per_step"] == pytest.approx(100.0)
    none = spec_keys(before, SpecSnapshot(3, before.verified, before.accepted, 4, 2, 0.5))
    assert none["accept_rate_pos1"] is None and none["mean_accepted_len_tokens"] is None
    assert spec_keys(None, None) == {"drafts_on": False, "nextn": 0}


def test_comparison_keys_are_the_plain_values_and_the_ratios():
    drafted = {"output_tok_per_s": 30.0, "ms_per_step": 12.0, "idle_gap_us_median": None}
    plain = {"output_tok_per_s": 20.0, "ms_per_step": 8.0, "idle_gap_us_median": None}
    keys = compare_to_plain(drafted, plain)
    assert keys["plain_output_tok_per_s"] == 20.0 and keys["output_tok_per_s_vs_plain"] == 1.5
    assert keys["plain_ms_per_step"] == 8.0 and keys["ms_per_step_vs_plain"] == 1.5
    assert keys["plain_idle_gap_us_median"] is None and keys["idle_gap_vs_plain"] is None
    assert "plain_measured_tok_per_s_per_user" not in keys  # neither record has it


def test_bench_throughput_runs_drafted_and_plain_in_one_run(tmp_path, monkeypatch):
    from deepinfer.cli import main

    path = make_v41_checkpoint(tmp_path / "v41", seed=0)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", str(path), "--num-requests", "3", "--min-input-len", "4"]
    argv += ["--max-input-len", "8", "--min-output-len", "6", "--max-output-len", "8", "--loops", "sync"]
    argv += ["--repeats", "1", "--block-size", "16", "--max-model-len", "48", "--output-json", str(out)]
    assert main(argv) == 0
    records = json.loads(out.read_text())
    drafted = next(r for r in records if r["drafts_on"])
    plain = next(r for r in records if not r["drafts_on"])
    assert len(records) == 2 and drafted["nextn"] == 2 and plain["nextn"] == 0
    assert drafted["output_tokens"] == plain["output_tokens"]  # same workload, ignore_eos
    assert drafted["drafted_steps"] > 0 and drafted["verified_drafts_pos1"] > 0
    rates = [drafted["accept_rate_pos1"], drafted["accept_rate_pos2"]]
    assert all(r is None or 0.0 <= r <= 1.0 for r in rates)
    # every emitted token is one per request-step plus the accepted drafts
    assert drafted["emitted_tokens_per_request_step"] == pytest.approx(
        1 + drafted["mean_accepted_len_tokens"]
    )
    assert drafted["plain_output_tok_per_s"] == plain["output_tok_per_s"]
    assert drafted["output_tok_per_s_vs_plain"] == pytest.approx(
        drafted["output_tok_per_s"] / plain["output_tok_per_s"]
    )
    assert drafted["ms_per_step_vs_plain"] == pytest.approx(drafted["ms_per_step"] / plain["ms_per_step"])
    assert plain["ms_per_step"] == pytest.approx(plain["elapsed_s"] * 1e3 / plain["steps"])
