"""Scoring stage: generations -> one line per sample with ``correct`` and ``extracted``.

AIME and GPQA are graded by fixed rules (math-verify; the answer-line convention). HLE goes to a
judge. A missing or empty response, or one whose reasoning never finished, counts as wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_eval.extract import aime_score, gpqa_score
from deepinfer_eval.judges import ExactMatchJudge, Judge, JudgeItem
from deepinfer_eval.records import Problem

GENERATION_FIELDS = ("benchmark", "id", "sample")


@dataclass
class ScoreSummary:
    scored: int = 0
    skipped_tasks: int = 0
    judge_errors: int = 0
    problems: list[Problem] = field(default_factory=list)


def _base(record: dict) -> dict:
    out = {"benchmark": record["benchmark"], "id": str(record["id"]), "sample": record["sample"]}
    for key in ("category", "finish_reason"):  # kept for breakdowns in the report
        if record.get(key) is not None:
            out[key] = record[key]
    return out


def score_records(
    records: list[dict],
    judge: Judge | None = None,
    source: str = "generations",
    aime_boxed: str = "last",
    gpqa_ignore_case: bool = False,
):
    """Scored lines in input order, and a summary; records need a ``_line`` for problem reports.

    The defaults are the reference conventions: AIME graded on the last ``\\boxed{}`` (``aime_boxed="all"``:
    math-verify over every box), GPQA's letter compared case-sensitively as simple-evals does
    (``gpqa_ignore_case=True``: upper-cased first), HLE by ``judge`` (default: the exact judge, which
    counts hedged multiple-choice answers wrong)."""
    judge = judge or ExactMatchJudge()
    summary = ScoreSummary()
    out: list[dict | None] = [None] * len(records)
    hle: list[int] = []
    for i, r in enumerate(records):
        line = r.get("_line", i + 1)
        if r.get("skipped"):
            out[i] = {**_base(r), "skipped": r["skipped"]}
            summary.skipped_tasks += 1
            continue
        sample = r.get("sample")
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
            summary.problems.append(
                Problem(source, line, f"field 'sample' must be an integer >= 0, got {r.get('sample')!r}")
            )
            continue
        if not isinstance(r.get("answer"), str):
            summary.problems.append(Problem(source, line, "field 'answer' must be a string"))
            continue
        response = r.get("response")
        if response is not None and not isinstance(response, str):
            summary.problems.append(Problem(source, line, "field 'response' must be a string or null"))
            continue
        bench = r["benchmark"]
        if bench == "aime":
            correct, extracted = aime_score(response, r["answer"], aime_boxed)
        elif bench == "gpqa":
            correct, extracted = gpqa_score(response, r["answer"], gpqa_ignore_case)
        elif bench == "hle":
            hle.append(i)
            continue
        else:
            summary.problems.append(
                Problem(source, line, f"benchmark must be aime, gpqa or hle, got {bench!r}")
            )
            continue
        out[i] = {**_base(r), "correct": correct, "extracted": extracted}
    if hle:
        items = [
            JudgeItem(
                records[i].get("question") or records[i].get("prompt") or "",
                records[i].get("response"),
                records[i]["answer"],
                records[i].get("answer_type", "exactMatch"),
            )
            for i in hle
        ]
        for i, verdict in zip(hle, judge.judge(items)):
            scored = {
                **_base(records[i]),
                "correct": verdict.correct,
                "extracted": verdict.extracted,
                "judge": judge.name,
            }
            if verdict.confidence is not None:
                scored["confidence"] = verdict.confidence
            if verdict.error:
                scored["judge_error"] = verdict.error
                summary.judge_errors += 1
            out[i] = scored
    scored_lines = [s for s in out if s is not None]
    summary.scored = sum(1 for s in scored_lines if "correct" in s)
    return scored_lines, summary
