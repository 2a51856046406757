"""Score and report stages through the CLI: malformed lines, missing responses, k, categories."""

import json

import pytest
from deepinfer_eval import build_report
from deepinfer_eval.cli import main


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_score_skips_malformed_lines_with_line_numbers_and_counts_missing_wrong(tmp_path, capsys):
    gen = _write(
        tmp_path / "gen.jsonl",
        [
            {
                "benchmark": "aime",
                "id": "a",
                "sample": 0,
                "answer": "042",
                "response": "\\boxed{42}",
                "finish_reason": "length",
            },
            '{"benchmark": "aime", "id": "a", "sample": 1, "answer": ',  # line 2: cut off
            {
                "benchmark": "aime",
                "id": "a",
                "sample": 1,
                "answer": "042",
                "response": None,
            },  # missing response
            {"benchmark": "aime", "id": "b", "answer": "1"},  # line 4: no sample
            "[1, 2]",  # line 5: not an object
            {"benchmark": "mmlu", "id": "c", "sample": 0, "answer": "A", "response": "A"},  # line 6
            {"benchmark": "gpqa", "id": "g", "sample": 0, "answer": "C", "response": "**Answer:** c"},
            {"benchmark": "gpqa", "id": "g", "sample": 1, "answer": "C"},  # no response field at all
        ],
    )
    out = tmp_path / "scores.jsonl"
    assert main(["score", "--generations", str(gen), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    for line in (2, 4, 5, 6):
        assert f"gen.jsonl line {line}:" in err
    scored = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(s["id"], s["sample"], s["correct"], s["extracted"]) for s in scored] == [
        ("a", 0, True, "42"),
        ("a", 1, False, None),
        ("g", 0, False, "c"),  # simple-evals compares the letter case-sensitively
        ("g", 1, False, None),
    ]
    assert main(["score", "--generations", str(gen), "--output", str(out), "--gpqa-ignore-case"]) == 0
    lenient = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(s["correct"], s["extracted"]) for s in lenient if s["id"] == "g"] == [(True, "C"), (False, None)]
    assert scored[0]["finish_reason"] == "length"
    report, _ = build_report(scored)
    assert report["benchmarks"]["aime"]["samples_truncated"] == 1


def test_report_pass_at_1_k_missing_samples_tasks_file_and_categories(tmp_path, capsys):
    scores = _write(
        tmp_path / "scores.jsonl",
        [
            {"benchmark": "aime", "id": "a", "sample": 0, "correct": True},
            {"benchmark": "aime", "id": "a", "sample": 1, "correct": True},
            {"benchmark": "aime", "id": "a", "sample": 2, "correct": False},
            {"benchmark": "aime", "id": "a", "sample": 3, "correct": True},
            {"benchmark": "aime", "id": "b", "sample": 0, "correct": True},  # samples 1..3 missing: wrong
            {"benchmark": "aime", "id": "b", "sample": 0, "correct": False},  # repeated sample: skipped
            {"benchmark": "aime", "id": "b", "sample": 1, "correct": "yes"},  # not a bool: skipped
            "not json",
            {
                "benchmark": "hle",
                "id": "h1",
                "sample": 0,
                "correct": True,
                "category": "Math",
                "confidence": 0.9,
            },
            {
                "benchmark": "hle",
                "id": "h2",
                "sample": 0,
                "correct": False,
                "category": "Math",
                "confidence": 0.8,
            },
            {
                "benchmark": "hle",
                "id": "h3",
                "sample": 0,
                "correct": True,
                "category": "Bio",
                "confidence": 0.5,
            },
            {"benchmark": "hle", "id": "h4", "sample": None, "skipped": "image input", "category": "Bio"},
            {"benchmark": "mmlu", "id": "m", "sample": 0, "correct": True},  # line 13: unknown benchmark
            {"benchmark": "aime", "id": "d", "sample": -1, "correct": True},  # line 14: no task "d" made
        ],
    )
    tasks = _write(
        tmp_path / "tasks.jsonl",
        [{"benchmark": "aime", "id": t, "problem": "p", "answer": "1"} for t in ("a", "b", "c")],
    )
    out = tmp_path / "report.json"
    assert main(["report", "--scores", str(scores), "--tasks", str(tasks), "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert "scores.jsonl line 6:" in captured.err and "line 7:" in captured.err and "line 8:" in captured.err
    assert "Pass@1" in captured.out and "1 task(s) skipped" in captured.out
    report = json.loads(out.read_text())
    aime = report["benchmarks"]["aime"]
    # k = 4; a: 3/4, b: 1/4 (three samples missing), c: never generated -> 0
    assert aime["samples_per_task"] == 4 and aime["tasks"] == 3 and aime["samples_missing"] == 7
    assert aime["pass_at_1"] == pytest.approx((0.75 + 0.25 + 0.0) / 3)
    assert report["skipped_lines"] == 5 and "line 13:" in captured.err and "line 14:" in captured.err
    assert set(report["benchmarks"]) == {"aime", "hle"}
    hle = report["benchmarks"]["hle"]
    assert hle["tasks"] == 3 and hle["skipped_tasks"] == 1 and hle["pass_at_1"] == pytest.approx(2 / 3)
    assert hle["categories"]["Math"]["pass_at_1"] == 0.5 and hle["categories"]["Bio"]["pass_at_1"] == 1.0
    assert hle["calibration_error"] == pytest.approx(abs((0.9 + 0.8 + 0.5) / 3 - 2 / 3))


def test_report_bootstrap_option_and_explicit_k():
    scores = [
        {"benchmark": "gpqa", "id": str(i), "sample": s, "correct": (i + s) % 3 == 0}
        for i in range(30)
        for s in range(2)
    ]
    report, problems = build_report(scores, samples=4, interval="bootstrap", resamples=2000)
    g = report["benchmarks"]["gpqa"]
    assert problems == [] and g["samples_per_task"] == 4 and g["samples_missing"] == 60
    assert g["ci95_low"] < g["pass_at_1"] < g["ci95_high"]
    with pytest.raises(ValueError, match="interval must be one of"):
        build_report(scores, interval="wald")


def test_cli_errors_are_clear(tmp_path, capsys):
    assert (
        main(["score", "--generations", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o")]) == 2
    )
    assert "No such file" in capsys.readouterr().err
    gen = _write(tmp_path / "g.jsonl", [])
    assert (
        main(["score", "--generations", str(gen), "--output", str(tmp_path / "o"), "--judge", "openai"]) == 2
    )
    assert "--judge-model" in capsys.readouterr().err


def test_score_conventions_and_their_lenient_modes(tmp_path):
    gen = _write(
        tmp_path / "gen.jsonl",
        [
            {
                "benchmark": "aime",
                "id": "a",
                "sample": 0,
                "answer": "13",
                "response": "\\boxed{12} or \\boxed{13}",
            },
            {
                "benchmark": "hle",
                "id": "h",
                "sample": 0,
                "answer": "B",
                "answer_type": "multipleChoice",
                "response": "Explanation: x\nAnswer: B or C\nConfidence: 50%",
            },
        ],
    )
    out = tmp_path / "scores.jsonl"

    def scores(*flags):
        assert main(["score", "--generations", str(gen), "--output", str(out), *flags]) == 0
        return [
            (s["id"], s["correct"], s["extracted"]) for s in map(json.loads, out.read_text().splitlines())
        ]

    assert scores() == [("a", True, "13"), ("h", False, "B or C")]
    assert scores("--aime-boxed", "all", "--hle-accept-hedged") == [
        ("a", False, "{12, 13}"),
        ("h", True, "B"),
    ]
