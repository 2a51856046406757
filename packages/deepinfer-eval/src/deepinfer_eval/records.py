"""JSONL files as the stages exchange them: read with line numbers, skip and report bad lines.

Every stage reads a file written by an earlier stage (or by hand), so one broken line must never
cost the other results: it is reported with its line number and left out.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Problem:
    """One input line that was skipped, and why."""

    path: str
    line: int  # 1-based
    reason: str
    unit: str = "line"  # "row" for upstream tables, whose rows need not be lines

    def __str__(self) -> str:
        return f"{self.path} {self.unit} {self.line}: {self.reason}"


@dataclass
class ReadResult:
    records: list[dict] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    ends_without_newline: bool = False  # a run killed mid-write leaves a partial last line


def read_jsonl(path: str | os.PathLike, required: Sequence[str] = ()) -> ReadResult:
    """Read a JSONL file; lines that are not JSON objects or lack a required key become Problems."""
    result = ReadResult()
    p = str(path)
    line = ""
    # Iterate the file, not str.splitlines(): JSON strings may hold raw U+2028 / U+0085, which
    # splitlines() treats as line breaks. Streaming also keeps long generation files out of memory.
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            _parse_line(line, lineno, p, required, result)
    result.ends_without_newline = bool(line) and not line.endswith("\n")
    return result


def _parse_line(line: str, lineno: int, p: str, required: Sequence[str], result: ReadResult) -> None:
    if not line.strip():
        return
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        result.problems.append(Problem(p, lineno, f"not valid JSON ({e.msg})"))
        return
    if not isinstance(record, dict):
        result.problems.append(Problem(p, lineno, "not a JSON object"))
        return
    missing = [k for k in required if k not in record]
    if missing:
        result.problems.append(Problem(p, lineno, f"missing field(s) {', '.join(missing)}"))
        return
    record["_line"] = lineno
    result.records.append(record)


def report_problems(problems: Iterable[Problem], stream=None) -> None:
    stream = stream or sys.stderr
    for problem in problems:
        print(f"skipped {problem}", file=stream)


def clean(record: dict) -> dict:
    """The record without bookkeeping keys (those starting with '_')."""
    return {k: v for k, v in record.items() if not k.startswith("_")}


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    n = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(clean(record), ensure_ascii=False) + "\n")
            n += 1
    return n


class JsonlAppender:
    """Appends records and flushes after each batch, so an interrupted run keeps what it wrote."""

    def __init__(self, path: str | os.PathLike):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        needs_newline = os.path.exists(path) and os.path.getsize(path) > 0 and not _ends_with_newline(path)
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if needs_newline:  # do not glue the first new record onto a partial line
            self._f.write("\n")

    def write(self, records: Iterable[dict]) -> None:
        for record in records:
            self._f.write(json.dumps(clean(record), ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ends_with_newline(path: str | os.PathLike) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
