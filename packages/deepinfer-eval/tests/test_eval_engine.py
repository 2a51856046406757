"""The generate stage on the real engine (built-in random-weight deepinfer-tiny), when installed."""

import json

import pytest

pytest.importorskip("deepinfer", reason="the engine is the optional extra deepinfer-eval[generate]")

from deepinfer_eval import EngineGenerator, SamplingConfig, run_generation  # noqa: E402


@pytest.mark.slow
def test_engine_generation_resumes_with_identical_samples(tmp_path):
    tasks = [
        {"benchmark": "aime", "id": f"t{i}", "problem": f"Compute {i} + 1.", "answer": str(i + 1)}
        for i in range(2)
    ]
    try:
        gen = EngineGenerator(None, SamplingConfig(temperature=0.8, top_p=0.95, max_tokens=6))
    except Exception as e:  # the engine's own tests cover building it; here we test our use of it
        pytest.skip(f"the engine's default model does not build here: {type(e).__name__}: {e}")
    try:
        full, holes = tmp_path / "full.jsonl", tmp_path / "holes.jsonl"
        run_generation(tasks, gen, full, samples=3, seed=4, progress=False)
        lines = [json.loads(x) for x in full.read_text().splitlines()]
        assert len(lines) == 6 and all(isinstance(r["response"], str) for r in lines)
        holes.write_text("".join(json.dumps(r) + "\n" for r in lines if (r["id"], r["sample"]) != ("t1", 1)))
        assert run_generation(tasks, gen, holes, samples=3, seed=4, progress=False).written == 1
    finally:
        gen.close()

    def key(r):
        return r["id"], r["sample"], r["seed"], r["response"]

    # seq_seed makes each sample a pure function of its seed: the refilled hole is the same text
    assert sorted(map(key, (json.loads(x) for x in holes.read_text().splitlines()))) == sorted(
        map(key, lines)
    )


@pytest.mark.slow
def test_max_tokens_cut_to_the_context_is_reported_as_such(tmp_path):
    from deepinfer_eval import build_report, read_jsonl, score_records

    tasks = [{"benchmark": "aime", "id": "t0", "problem": "Compute 1 + 1.", "answer": "2"}]
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, max_tokens=100)
    try:
        gen = EngineGenerator(None, sampling, max_model_len=64)
    except Exception as e:
        pytest.skip(f"the engine's default model does not build here: {type(e).__name__}: {e}")
    try:
        out = tmp_path / "gen.jsonl"
        summary = run_generation(tasks, gen, out, samples=2, seed=0, sampling=sampling, progress=False)
    finally:
        gen.close()
    assert any(
        "max_tokens 100 does not fit the engine's context (max_model_len 64" in w for w in summary.warnings
    )
    lines = read_jsonl(out).records
    reasons = [r["finish_reason"] for r in lines]
    assert "context" in reasons and "length" not in reasons, reasons
    report, _ = build_report(score_records(lines)[0])
    entry = report["benchmarks"]["aime"]
    assert entry["samples_cut_at_context"] == reasons.count("context") and entry["samples_truncated"] == 0
