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


def _vision_checkpoint(path):
    """The tiny V4.1 with its small vision tower and the tokenizer's full vocabulary (the HLE prompt is
    English text, tokenized by the real tokenizer)."""
    from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint, tiny_v41_config_dict

    config = tiny_v41_config_dict(vision_tower=True)
    config["text_config"]["vocab_size"] = 129280
    return make_v41_checkpoint(path, config)


@pytest.mark.slow
def test_hle_run_with_image_tasks_end_to_end(tmp_path):
    """Convert an upstream-format HLE file mixing text and image tasks, generate on a V4.1 with a vision
    tower, and rescore where torch and the engine cannot be imported: the image tasks reach the engine
    with their image blocks, and the scores are the same."""
    from deepinfer_eval import read_jsonl, read_tasks, score_records
    from deepinfer_eval.cli import main
    from eval_common import data_url, png, run_without_engine, write_upstream_hle

    rows = [
        {"id": "txt-1", "question": "What is 2 + 2?", "answer": "4", "answer_type": "exactMatch"},
        {
            "id": "img-1",
            "question": "What color fills the image?",
            "image": data_url(png((200, 0, 0), (56, 56))),
        },
        {
            "id": "txt-2",
            "question": "Pick one.\nA) yes\nB) no",
            "answer": "A",
            "answer_type": "multipleChoice",
        },
        {"id": "img-2", "question": "How wide is it?", "image": data_url(png((0, 0, 200), (84, 56)))},
    ]
    for r in rows:
        r.setdefault("answer", "red")
        r.setdefault("answer_type", "exactMatch")
        r["category"] = "Other"
    # 56 x 56 and 84 x 56 pixels in 28-pixel cells: 2 x 2 and 2 x 3 cells, rows * (cols + 1) + 2 positions
    block = {"img-1": 2 * 3 + 2, "img-2": 2 * 4 + 2}
    write_upstream_hle(tmp_path / "hle.parquet", rows)
    assert main(["convert", "--benchmark", "hle", "--input", str(tmp_path / "hle.parquet"),
                 "--output", str(tmp_path / "tasks.jsonl")]) == 0  # fmt: skip
    tasks, problems = read_tasks(tmp_path / "tasks.jsonl", "hle")
    assert problems == [] and [bool(t["image"]) for t in tasks] == [False, True, False, True]

    sampling = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=4)
    gen = EngineGenerator(str(_vision_checkpoint(tmp_path / "v41-vision")), sampling, block_size=4)
    try:
        out = tmp_path / "gen.jsonl"
        summary = run_generation(tasks, gen, out, samples=2, seed=0, sampling=sampling, progress=False)
        lines = read_jsonl(out).records
        # the same prompts without their images, through the same engine
        text_only = gen.generate(
            [[{"role": "user", "content": r["prompt"]}] for r in lines], 1, [0] * len(lines)
        )
    finally:
        gen.close()
    assert (summary.written, summary.failed, summary.image_tasks) == (8, 0, 2)
    assert all(isinstance(r["response"], str) and "error" not in r for r in lines)
    stride = 2  # the tiny config's compression stride: an image block may start after one pad
    for r, (plain,) in zip(lines, text_only, strict=True):
        grown = r["prompt_tokens"] - plain.prompt_tokens
        if r["id"] in block:
            assert block[r["id"]] <= grown < block[r["id"]] + stride, (r["id"], grown)
            assert len(r["image_sha256"]) == 64
        else:
            assert grown == 0 and "image_sha256" not in r

    scored, _ = score_records(lines)
    proc = run_without_engine(
        "from deepinfer_eval.cli import main\n"
        "assert main(['score', '--generations', 'gen.jsonl', '--output', 'scores.jsonl']) == 0\n",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    rescored = [json.loads(x) for x in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert rescored == [{k: v for k, v in s.items() if not k.startswith("_")} for s in scored]
    assert len(rescored) == 8 and not any(s.get("skipped") for s in rescored)
