"""JSONL round trips: unusual characters stay inside their line; partial last lines are detected."""

from deepinfer_eval import read_jsonl, write_jsonl
from deepinfer_eval.records import JsonlAppender


def test_line_separators_inside_strings_do_not_split_records(tmp_path):
    path = tmp_path / "x.jsonl"
    text = "a\u2028b\u0085c\u2029d\x1ce\r\nf"  # characters str.splitlines() would break on
    write_jsonl(path, [{"id": "1", "response": text, "_line": 9}, {"id": "2", "response": "ok"}])
    result = read_jsonl(path, required=("id",))
    assert result.problems == [] and [r["response"] for r in result.records] == [text, "ok"]
    assert [r["_line"] for r in result.records] == [1, 2] and not result.ends_without_newline


def test_appender_starts_a_new_line_after_a_partial_one(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"id": "1"}\n{"id": "2", "resp')
    assert read_jsonl(path).ends_without_newline
    with JsonlAppender(path) as out:
        out.write([{"id": "3"}])
    result = read_jsonl(path, required=("id",))
    assert [r["id"] for r in result.records] == ["1", "3"] and [p.line for p in result.problems] == [2]
