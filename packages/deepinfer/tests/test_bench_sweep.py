"""`deepinfer bench sweep` end to end on the CPU tiny model: JSON rows, two Pareto PNGs, a profile trace;
and the roofline's inputs (model costs, ceilings) against values computed from the config."""

import json

import pytest
import torch
from deepinfer import EngineArgs
from deepinfer.bench import Ceilings, decode_roof, measure_ceilings, model_costs, prefill_roof

ENGINE_DEVICE = EngineArgs().torch_device.type


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from deepinfer.cli import main

    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    argv = ["bench", "sweep", "--chunks", "8,16", "--prefill-context", "16", "--prefill-warmup", "1"]
    argv += ["--prefill-repeats", "2", "--batches", "1,2", "--decode-context", "8", "--warmup-steps", "1"]
    argv += ["--measure-steps", "2", "--num-threads", "1", "--no-progress", "--results-dir", str(out)]
    argv += ["--profile-decode-batch", "2", "--profile-steps", "1", "--name", "t", "--nextn", "1"]
    argv += ["--profile-prefill-chunk", "16", "--profile-stacks"]
    try:
        assert main(argv) == 0  # --num-threads 1 sets torch's thread count; put it back for other tests
    finally:
        torch.set_num_threads(threads)
    return out


def test_sweep_writes_json_rows_for_both_phases(sweep):
    rows = json.loads((sweep / "t.json").read_text())
    prefill = [r for r in rows if r["phase"] == "prefill"]
    decode = [r for r in rows if r["phase"] == "decode"]
    assert [r["chunk_tokens"] for r in prefill] == [8, 16]
    assert [r["batch"] for r in decode] == [1, 2]
    for r in prefill:
        assert r["context_tokens"] == 16 and r["intervals"] + r["dropped_flagged_intervals"] == 2
        # tokens/s/GPU is the chunk over its measured latency (one GPU-equivalent)
        assert r["non_cached_tok_per_s_per_gpu"] == pytest.approx(
            r["chunk_tokens"] / (r["chunk_latency_ms"] / 1e3)
        )
        assert 0 < r["fraction_of_roofline"] < 1
        # the engine's device ($DEEPINFER_DEVICE, else cuda when present): its ceilings, measured in-run
        assert r["ceiling_source"] == "measured" and r["device"].startswith("cpu") == (ENGINE_DEVICE == "cpu")
    for r in decode:
        assert r["intervals"] + r["dropped_flagged_intervals"] == 2
        assert r["full_acceptance_tok_per_s_per_gpu"] == pytest.approx(
            r["steps_per_s"] * r["batch"] * (1 + r["nextn"])
        )
        assert r["steps_per_s"] == pytest.approx(1e3 / r["ms_per_step"])
        # measured accounting = the engine's emitted tokens: 1 per request-step + accepted drafts
        assert r["nextn"] == 1 and r["window_drafts_verified"] == r["intervals"] * r["batch"] * r["nextn"]
        accepted_per_req_step = r["window_drafts_accepted"] / (r["intervals"] * r["batch"])
        assert r["measured_tokens_per_request_step"] == pytest.approx(1 + accepted_per_req_step)
        assert r["measured_tok_per_s_per_gpu"] <= r["full_acceptance_tok_per_s_per_gpu"] * (1 + 1e-9)
    assert "profile_trace" in decode[1] and "profile_trace" not in decode[0]
    assert "profile_trace" in prefill[1] and "profile_trace" not in prefill[0]
    for row in (decode[1], prefill[1]):  # --profile-stacks: the traces name our Python frames
        events = json.loads(open(row["profile_trace"]).read())["traceEvents"]
        frames = [e["name"] for e in events if e.get("cat") == "python_function"]
        assert any("deepinfer_model" in f for f in frames), frames[:5]


def test_sweep_writes_a_png_per_phase(sweep):
    for phase in ("prefill", "decode"):
        data = (sweep / f"t_{phase}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_model_costs_of_the_tiny_model_match_its_config():
    from deepinfer.default_model import resolve_model
    from deepinfer_model import load_model

    path, _ = resolve_model(None)
    model = load_model(path, torch.float32)
    cfg = model.config
    costs = model_costs(model)
    assert costs.head_params == cfg.vocab_size * cfg.hidden_size
    # w1, w3: [E, inter, hidden], w2: [E, hidden, inter] in every MoE layer
    moe_layers = sum(t == "moe" for t in cfg.mlp_layer_types)
    assert (
        costs.routed_params
        == moe_layers * 3 * cfg.n_routed_experts * cfg.moe_intermediate_size * cfg.hidden_size
    )
    assert (costs.top_k, costs.num_experts) == (cfg.num_experts_per_tok, cfg.n_routed_experts)
    per_token = 2 * (
        costs.dense_params + costs.routed_params * cfg.num_experts_per_tok / cfg.n_routed_experts
    )
    assert costs.flops_per_token == pytest.approx(per_token)
    assert costs.prefill_flops(10) == pytest.approx(
        10 * (per_token - 2 * costs.head_params) + 2 * costs.head_params
    )
    # one token touches top_k of E experts; very many tokens touch them all
    assert costs.step_bytes(1) == pytest.approx(costs.dense_bytes + costs.routed_bytes * 2 / 8)
    assert costs.step_bytes(10_000) == pytest.approx(costs.dense_bytes + costs.routed_bytes)


def test_roofline_is_the_slower_of_compute_and_weight_reads():
    from deepinfer.bench import ModelCosts

    costs = ModelCosts(dense_params=10**9, head_params=0, routed_params=0, dense_bytes=2 * 10**9,
                       routed_bytes=0, top_k=0, num_experts=0)  # fmt: skip
    ceil = Ceilings("test", tflops=1000.0, tbps=4.0, source="datasheet")
    # batch 1: compute 2e9 / 1e15 = 2 us, weights 2e9 / 4e12 = 500 us -> memory bound, 2000 tok/s
    user, gpu = decode_roof(costs, ceil, 1)
    assert (user, gpu) == (pytest.approx(2000.0), pytest.approx(2000.0))
    # batch 1000: compute 2e12 / 1e15 = 2 ms > 0.5 ms -> compute bound: 500 steps/s, 500 000 tok/s/GPU
    user, gpu = decode_roof(costs, ceil, 1000)
    assert (user, gpu) == (pytest.approx(500.0), pytest.approx(500_000.0))
    # nextn 1 at batch 1: two tokens per step, same 500 us step -> 4000 tok/s per user
    assert decode_roof(costs, ceil, 1, nextn=1)[0] == pytest.approx(4000.0)
    latency, tok_s = prefill_roof(costs, ceil, 4096)
    assert latency == pytest.approx(4096 * 2e9 / 1e15) and tok_s == pytest.approx(500_000.0)


def test_measured_ceilings_are_positive_and_accepted_by_the_peak_table():
    from deepinfer_cluster import peak_rates

    m = measure_ceilings(torch.device("cpu"), torch.float32)
    assert m["bf16_tflops"] > 0 and m["hbm_tbps"] > 0
    assert peak_rates("some cpu", m).source == "measured"


def test_drafted_decode_rows_report_acceptance_and_the_plain_run(sweep):
    """--nextn 1: each decode row carries the window's acceptance per draft position and the same batch
    decoded with drafts off in the same run (plain_* values, drafted / plain ratios)."""
    rows = json.loads((sweep / "t.json").read_text())
    for r in (r for r in rows if r["phase"] == "decode"):
        assert r["drafts_on"] and r["nextn"] == 1
        assert r["verified_drafts_pos1"] == r["window_drafts_verified"]
        assert r["accept_rate_pos1"] == pytest.approx(r["window_draft_accept_rate"])
        assert r["mean_accepted_len_tokens"] == pytest.approx(
            r["window_drafts_accepted"] / (r["intervals"] * r["batch"])
        )
        assert r["plain_ms_per_step"] > 0
        assert r["ms_per_step_vs_plain"] == pytest.approx(r["ms_per_step"] / r["plain_ms_per_step"])
        assert r["tok_per_s_per_user_vs_plain"] == pytest.approx(
            r["measured_tok_per_s_per_user"] / r["plain_measured_tok_per_s_per_user"]
        )
