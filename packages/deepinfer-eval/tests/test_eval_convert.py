"""Conversion of each upstream form (CSV, JSON, JSONL, parquet) from small fixtures."""

import csv
import io
import json

import pytest
from deepinfer_eval import convert_file
from eval_common import data_url, png, write_upstream_hle

AIME_ROWS = [
    {"id": "2026-I-1", "problem": "Find x, given that x + 1 = 43.", "answer": "042"},
    {"id": "2026-I-2", "problem": "Compute 3 + 4.", "answer": "7"},
    {"id": "2026-I-3", "problem": "An answer out of range.", "answer": "1000"},
    {"id": "2026-I-4", "problem": "NA", "answer": "NA"},
]


def _write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _write_parquet(path, rows):
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_aime_csv_keeps_answers_as_strings_and_reports_bad_rows(tmp_path):
    tasks, problems = convert_file("aime", _write_csv(tmp_path / "aime.csv", AIME_ROWS))
    assert [(t["id"], t["answer"]) for t in tasks] == [("2026-I-1", "042"), ("2026-I-2", "7")]
    assert tasks[0]["problem"] == "Find x, given that x + 1 = 43."
    assert [(p.line, p.unit) for p in problems] == [(3, "row"), (4, "row")]
    assert "0-999" in problems[0].reason


def test_aime_problem_idx_integer_variant_jsonl(tmp_path):
    rows = [
        {"problem_idx": 1, "problem": "p1", "answer": 42},
        {"problem_idx": 2, "problem": "p2", "answer": 0},
    ]
    tasks, problems = convert_file("aime", _write_jsonl(tmp_path / "aime.jsonl", rows))
    assert problems == []
    assert tasks == [
        {"benchmark": "aime", "id": "1", "problem": "p1", "answer": "42"},
        {"benchmark": "aime", "id": "2", "problem": "p2", "answer": "0"},
    ]


def test_aime_parquet_and_json_array(tmp_path):
    rows = [{"id": "a", "problem": "p", "answer": "007"}]
    for path in (_write_parquet(tmp_path / "aime.parquet", rows), tmp_path / "aime.json"):
        if path.suffix == ".json":
            path.write_text(json.dumps(rows), encoding="utf-8")
        tasks, problems = convert_file("aime", path)
        assert problems == [] and tasks[0]["answer"] == "007"


GPQA_ROWS = [
    {
        "Record ID": "rec1",
        "Question": "Which gas, at STP,\nis lightest?",
        "Correct Answer": " Hydrogen",
        "Incorrect Answer 1": "Helium",
        "Incorrect Answer 2": "Neon",
        "Incorrect Answer 3": "Argon",
        "High-level domain": "Chemistry",
        "Subdomain": "General",
    },
    {
        "Record ID": "rec2",
        "Question": "2 + 2?",
        "Correct Answer": "4",
        "Incorrect Answer 1": "3",
        "Incorrect Answer 2": "5",
        "Incorrect Answer 3": "",
        "High-level domain": "Math",
        "Subdomain": "x",
    },
]


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_gpqa_original_columns(tmp_path, fmt):
    path = tmp_path / f"gpqa.{fmt}"
    if fmt == "csv":
        _write_csv(path, GPQA_ROWS)
    else:
        path.write_text(json.dumps(GPQA_ROWS), encoding="utf-8")
    tasks, problems = convert_file("gpqa", path)
    assert tasks == [
        {
            "benchmark": "gpqa",
            "id": "rec1",
            "question": "Which gas, at STP,\nis lightest?",
            "correct": "Hydrogen",
            "incorrect": ["Helium", "Neon", "Argon"],
            "category": "Chemistry",
        }
    ]
    assert len(problems) == 1 and problems[0].line == 2 and "incorrect 3" in problems[0].reason


PNG_URL = data_url(png((200, 30, 30)))

HLE_ROWS = [
    {
        "id": "h1",
        "question": "Capital of France?",
        "image": "",
        "answer": "Paris",
        "answer_type": "exactMatch",
        "category": "Humanities/Social Science",
        "rationale": "well known",
    },
    {
        "id": "h2",
        "question": "Pick one.\nA) x\nB) y",
        "image": PNG_URL,
        "answer": "B",
        "answer_type": "multipleChoice",
        "category": "Other",
        "rationale": "",
    },
    {
        "id": "h3",
        "question": "q",
        "image": "",
        "answer": "1",
        "answer_type": "freeForm",
        "category": "Math",
        "rationale": "",
    },
    {
        "id": "h1",
        "question": "again",
        "image": "",
        "answer": "1",
        "answer_type": "exactMatch",
        "category": "Math",
        "rationale": "",
    },
]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_hle_forms(tmp_path, fmt):
    path = tmp_path / f"hle.{fmt}"
    (_write_parquet if fmt == "parquet" else _write_jsonl)(path, HLE_ROWS)
    tasks, problems = convert_file("hle", path)
    assert [t["id"] for t in tasks] == ["h1", "h2"]
    assert tasks[1] == {
        "benchmark": "hle",
        "id": "h2",
        "question": "Pick one.\nA) x\nB) y",
        "image": PNG_URL,
        "answer": "B",
        "answer_type": "multipleChoice",
        "category": "Other",
    }
    assert [p.line for p in problems] == [3, 4]
    assert "answer_type" in problems[0].reason and "repeats" in problems[1].reason


def test_hle_upstream_parquet_keeps_images_and_reports_bad_ones_by_task(tmp_path):
    from PIL import Image

    jpeg = io.BytesIO()
    Image.new("RGB", (16, 16), (0, 90, 0)).save(jpeg, format="JPEG")
    rows = [
        {
            "id": "t-text",
            "question": "2 + 2?",
            "answer": "4",
            "answer_type": "exactMatch",
            "category": "Math",
        },
        {"id": "t-png", "question": "Color?", "image": PNG_URL, "answer": "red", "answer_type": "exactMatch"},
        {
            "id": "t-jpeg",
            "question": "Which?\nA) a\nB) b",
            "image": data_url(jpeg.getvalue(), "jpeg"),
            "answer": "A",
            "answer_type": "multipleChoice",
            "category": "Other",
        },
        {"id": "t-cut", "question": "q", "image": data_url(png((1, 2, 3))[:40]), "answer": "x"},
        {"id": "t-b64", "question": "q", "image": "data:image/png;base64,@@@", "answer": "x"},
        {"id": "t-url", "question": "q", "image": "https://example.com/a.png", "answer": "x"},
    ]
    for r in rows[3:]:
        r["answer_type"] = "exactMatch"
    tasks, problems = convert_file("hle", write_upstream_hle(tmp_path / "test.parquet", rows))
    assert [t["id"] for t in tasks] == ["t-text", "t-png", "t-jpeg"]
    assert [t["image"] for t in tasks] == ["", PNG_URL, rows[2]["image"]]  # kept as the upstream string
    assert tasks[2]["answer_type"] == "multipleChoice" and tasks[0]["category"] == "Math"
    assert [p.line for p in problems] == [4, 5, 6]
    assert problems[0].reason.startswith("task 't-cut': field 'image': the image does not decode")
    assert problems[1].reason.startswith("task 't-b64': field 'image': the data: URL's base64 content")
    assert problems[2].reason.startswith("task 't-url': field 'image': must be a data: URL")

    # the same tasks with `image` as an Image column: bytes become a data URL of the image's own format
    tasks, problems = convert_file("hle", write_upstream_hle(tmp_path / "resaved.parquet", rows[:3], True))
    assert problems == [] and [t["image"] for t in tasks] == ["", PNG_URL, rows[2]["image"]]


def test_hle_task_file_round_trip_keeps_the_image(tmp_path):
    from deepinfer_eval import read_tasks
    from deepinfer_eval.records import write_jsonl

    tasks, _ = convert_file("hle", _write_jsonl(tmp_path / "hle.jsonl", HLE_ROWS))
    write_jsonl(tmp_path / "tasks.jsonl", tasks)
    again, problems = read_tasks(tmp_path / "tasks.jsonl", "hle")
    assert problems == [] and [t["image"] for t in again] == ["", PNG_URL]


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("hi")
    with pytest.raises(ValueError, match="unsupported file type"):
        convert_file("aime", path)
    with pytest.raises(ValueError, match="benchmark must be one of"):
        from deepinfer_eval import convert_rows

        convert_rows("mmlu", [])


def test_read_tasks_checks_fields_and_makes_ids_and_answers_strings(tmp_path):
    from deepinfer_eval import read_tasks

    path = _write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            {"benchmark": "aime", "id": 7, "problem": "p", "answer": 42},
            {"benchmark": "gpqa", "id": "g", "question": "q", "correct": "c", "incorrect": ["x", "y"]},
            {"benchmark": "aime", "id": 8, "problem": "p"},
        ],
    )
    tasks, problems = read_tasks(path)
    assert tasks[0]["id"] == "7" and tasks[0]["answer"] == "42" and len(tasks) == 1
    assert [(p.line, "incorrect" in p.reason or "answer" in p.reason) for p in problems] == [
        (2, True),
        (3, True),
    ]
    tasks, problems = read_tasks(path, "gpqa")
    assert tasks == [] and "benchmark must be gpqa" in problems[0].reason


def test_unreadable_and_missing_inputs_are_value_errors(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="could not read"):
        convert_file("hle", bad)
    with pytest.raises(ValueError, match="no such file"):
        convert_file("hle", tmp_path / "absent.jsonl")


def test_engine_args_parse():
    from deepinfer_eval.cli import parse_engine_args

    assert parse_engine_args(["max_model_len=40960", "tokenizer=/x", "trust_remote_code=true"]) == {
        "max_model_len": 40960,
        "tokenizer": "/x",
        "trust_remote_code": True,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_engine_args(["oops"])
