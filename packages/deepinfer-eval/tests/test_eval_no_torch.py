"""Convert, score and report work where torch and the engine are not importable."""

import json
import textwrap

from eval_common import run_without_engine as _run


def test_package_imports_without_torch(tmp_path):
    code = "import deepinfer_eval, deepinfer_eval.cli, deepinfer_eval.generate, deepinfer_eval.judges\n"
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_convert_score_report_cli_without_torch(tmp_path):
    (tmp_path / "aime.csv").write_text("id,problem,answer\nI-1,Compute 40 + 2.,042\nI-2,Compute 1 + 1.,2\n")
    gen = [
        {
            "benchmark": "aime",
            "id": "I-1",
            "sample": 0,
            "answer": "042",
            "response": "<think>40+2</think>\\boxed{42}",
        },
        {"benchmark": "aime", "id": "I-1", "sample": 1, "answer": "042", "response": "\\boxed{41}"},
        {"benchmark": "aime", "id": "I-2", "sample": 0, "answer": "2", "response": "\\boxed{2}"},
        {"benchmark": "gpqa", "id": "g", "sample": 0, "answer": "B", "response": "Answer: B"},
        {
            "benchmark": "hle",
            "id": "h",
            "sample": 0,
            "answer": "Paris",
            "answer_type": "exactMatch",
            "category": "Geo",
            "response": "Exact Answer: paris\nConfidence: 80%",
        },
    ]
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen) + "{broken\n")
    code = textwrap.dedent("""
        from deepinfer_eval.cli import main
        assert main(["convert", "--benchmark", "aime", "--input", "aime.csv", "--output", "tasks.jsonl"]) == 0
        assert main(["score", "--generations", "gen.jsonl", "--output", "scores.jsonl"]) == 0
        assert main(["report", "--scores", "scores.jsonl", "--tasks", "tasks.jsonl", "--output", "r.json"]) == 0
    """)
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "gen.jsonl line 6:" in proc.stderr  # the broken line, reported and skipped
    tasks = [json.loads(x) for x in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert [t["answer"] for t in tasks] == ["042", "2"]
    scores = [json.loads(x) for x in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert [s["correct"] for s in scores] == [True, False, True, True, True]
    report = json.loads((tmp_path / "r.json").read_text())["benchmarks"]
    assert report["aime"]["pass_at_1"] == 0.5  # k = 2: I-1 1/2, I-2 1/2 (sample 1 missing)
    assert abs(report["hle"]["calibration_error"] - 0.2) < 1e-12


def test_generate_without_the_engine_is_one_line_and_exit_2(tmp_path):
    """The generate stage where the engine (an optional extra) is not installed: one line that says what
    to install, exit status 2, no traceback."""
    (tmp_path / "aime.csv").write_text("id,problem,answer\nI-1,Compute 40 + 2.,042\n")
    code = textwrap.dedent("""
        from deepinfer_eval.cli import main
        assert main(["convert", "--benchmark", "aime", "--input", "aime.csv", "--output", "tasks.jsonl"]) == 0
        argv = ["generate", "--benchmark", "aime", "--tasks", "tasks.jsonl", "--samples", "1"]
        print("status", main(argv + ["--output", "gen.jsonl"]))
    """)
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "status 2" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [
        "deepinfer-eval generate: error: the generate stage needs the engine: "
        "pip install 'deepinfer-eval[generate]'"
    ]
    assert "Traceback" not in proc.stderr
