"""Convert an upstream copy of a benchmark (CSV, JSON, JSONL or parquet) to our task JSONL.

Files are read with ``datasets`` (imported lazily, only this stage needs it). Every value is kept
as a string: a CSV is read with all columns typed as strings, so AIME's "042" stays "042".
Rows that do not fit are reported with their row number and left out; the others convert.

Task records, one per line:
  aime: {"benchmark", "id", "problem", "answer"}
  gpqa: {"benchmark", "id", "question", "correct", "incorrect": [3 strings], "category"}
  hle:  {"benchmark", "id", "question", "image", "answer", "answer_type", "category"}
        ("image": the task's image as a data: URL, "" for a text task; images.py)
"""

from __future__ import annotations

import csv
import os
import re
import tempfile
from pathlib import Path

from deepinfer_eval.images import image_data_url
from deepinfer_eval.records import Problem

BENCHMARKS = ("aime", "gpqa", "hle")
HLE_ANSWER_TYPES = ("exactMatch", "multipleChoice")
_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_rows(path: str | os.PathLike) -> list[dict]:
    """All rows of a CSV / JSON / JSONL / parquet file as dicts (CSV cells always strings)."""
    suffix = Path(path).suffix.lower()
    if suffix not in _BUILDERS:
        raise ValueError(f"input: unsupported file type {suffix!r}; allowed: {', '.join(_BUILDERS)}")
    from datasets import Features, Value, disable_progress_bars, load_dataset  # lazy: only convert needs it

    disable_progress_bars()  # a table of a few hundred rows loads in well under a second

    kwargs: dict = {}
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
        # Typing every column as string keeps "042" and "NA"; pandas would infer 42 and NaN.
        kwargs = dict(features=Features({c: Value("string") for c in header}), keep_default_na=False)
    with tempfile.TemporaryDirectory(prefix="deepinfer-eval-") as cache:  # never reuse a stale cache
        if not os.path.exists(path):
            raise ValueError(f"input: no such file {str(path)!r}")
        try:
            ds = load_dataset(
                _BUILDERS[suffix], data_files=str(path), split="train", cache_dir=cache, **kwargs
            )
        except Exception as e:  # datasets/pyarrow raise many types; the user needs the file and why
            raise ValueError(
                f"input: could not read {str(path)!r} as {suffix[1:]}: {type(e).__name__}: {e}"
            ) from e
        return ds.to_list()


def _text(value) -> str:
    """A cell as a string; integral floats (from a typed JSON/parquet column) lose the '.0'."""
    if value is None:
        return ""
    if isinstance(value, bool):
        raise ValueError("a boolean where text was expected")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _pick(row: dict, *names: str) -> str | None:
    for name in names:
        if name in row and row[name] is not None:
            return _text(row[name])
    return None


def _require(row: dict, field: str, *names: str) -> str:
    value = _pick(row, *names)
    if value is None or not value.strip():
        raise ValueError(f"field {field!r} (column {' / '.join(names)}) is missing or empty")
    return value


def convert_aime(row: dict, index: int) -> dict:
    answer = _require(row, "answer", "answer", "Answer").strip()
    if not re.fullmatch(r"\d{1,3}", answer):
        raise ValueError(
            f"field 'answer' must be an integer 0-999 written with 1 to 3 digits, got {answer!r}"
        )
    task_id = _pick(row, "id", "problem_idx", "ID") or str(index)
    return {
        "benchmark": "aime",
        "id": task_id.strip(),
        "problem": _require(row, "problem", "problem", "Problem", "question"),
        "answer": answer,
    }


def convert_gpqa(row: dict, index: int) -> dict:
    incorrect = [_require(row, f"incorrect {i}", f"Incorrect Answer {i}").strip() for i in (1, 2, 3)]
    return {
        "benchmark": "gpqa",
        "id": (_pick(row, "Record ID", "id") or str(index)).strip(),
        "question": _require(row, "question", "Question"),
        "correct": _require(row, "correct", "Correct Answer").strip(),
        "incorrect": incorrect,
        "category": (_pick(row, "High-level domain") or "").strip(),
    }


def convert_hle(row: dict, index: int) -> dict:
    answer_type = _require(row, "answer_type", "answer_type").strip()
    if answer_type not in HLE_ANSWER_TYPES:
        raise ValueError(
            f"field 'answer_type' must be one of {', '.join(HLE_ANSWER_TYPES)}, got {answer_type!r}"
        )
    task_id = _require(row, "id", "id").strip()
    # the task's image, decoded once here so that a bad one is reported with its task (images.py)
    image = image_data_url(row.get("image"), f"task {task_id!r}: field 'image'")
    return {
        "benchmark": "hle",
        "id": task_id,
        "question": _require(row, "question", "question"),
        "image": image,
        "answer": _require(row, "answer", "answer").strip(),
        "answer_type": answer_type,
        "category": (_pick(row, "category") or "").strip(),
    }


_CONVERTERS = {"aime": convert_aime, "gpqa": convert_gpqa, "hle": convert_hle}


def convert_rows(benchmark: str, rows: list[dict], source: str = "input") -> tuple[list[dict], list[Problem]]:
    """Tasks from upstream rows; a bad row or a repeated id becomes a Problem (row numbers 1-based)."""
    if benchmark not in _CONVERTERS:
        raise ValueError(f"benchmark must be one of {', '.join(BENCHMARKS)}, got {benchmark!r}")
    tasks, problems, seen = [], [], set()
    for index, row in enumerate(rows, start=1):
        try:
            task = _CONVERTERS[benchmark](row, index)
        except ValueError as e:
            problems.append(Problem(source, index, str(e), unit="row"))
            continue
        if task["id"] in seen:
            problems.append(Problem(source, index, f"id {task['id']!r} repeats an earlier row", unit="row"))
            continue
        seen.add(task["id"])
        tasks.append(task)
    return tasks, problems


def convert_file(benchmark: str, path: str | os.PathLike) -> tuple[list[dict], list[Problem]]:
    return convert_rows(benchmark, load_rows(path), source=str(path))


_TASK_FIELDS = {
    "aime": ("id", "problem", "answer"),
    "gpqa": ("id", "question", "correct", "incorrect"),
    "hle": ("id", "question", "answer", "answer_type"),
}


def read_tasks(path: str | os.PathLike, benchmark: str | None = None) -> tuple[list[dict], list[Problem]]:
    """Task JSONL as written by ``convert``; bad lines become Problems, ids become strings."""
    from deepinfer_eval.records import read_jsonl

    result = read_jsonl(path, required=("benchmark",))
    tasks, problems = [], list(result.problems)
    for r in result.records:
        bench = r["benchmark"]
        if bench not in _TASK_FIELDS or (benchmark and bench != benchmark):
            want = benchmark or " / ".join(BENCHMARKS)
            problems.append(Problem(str(path), r["_line"], f"benchmark must be {want}, got {bench!r}"))
            continue
        missing = [k for k in _TASK_FIELDS[bench] if k not in r]
        if (
            bench == "gpqa"
            and not missing
            and not (isinstance(r["incorrect"], list) and len(r["incorrect"]) == 3)
        ):
            missing = ["incorrect (a list of 3 strings)"]
        if missing:
            problems.append(Problem(str(path), r["_line"], f"missing field(s) {', '.join(missing)}"))
            continue
        r["id"] = str(r["id"])
        if "answer" in r:  # a hand-written file may hold 42 where convert would write "42"
            r["answer"] = _text(r["answer"])
        tasks.append(r)
    return tasks, problems
