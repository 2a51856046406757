"""Report stage: scored samples -> Pass@1 with a 95% interval per benchmark (and HLE category).

k is the number of samples per task: ``samples`` if given, else the most any task of the benchmark
has. A task with fewer scored samples, or (with ``tasks``) none at all, counts the missing ones as
wrong, as the official harnesses do.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from deepinfer_eval.convert import BENCHMARKS
from deepinfer_eval.records import Problem
from deepinfer_eval.stats import bootstrap_interval, calibration_error, clustered_interval, pass_at_1

INTERVALS = ("clustered", "bootstrap")


@dataclass
class _Task:
    category: str = ""
    correct: dict[int, bool] = field(default_factory=dict)
    skipped: bool = False


def _summary(tasks: list[_Task], k: int, interval: str, resamples: int, seed: int) -> dict:
    rates = [sum(t.correct.values()) / k for t in tasks]
    ci = bootstrap_interval(rates, resamples, seed) if interval == "bootstrap" else clustered_interval(rates)
    return {
        "tasks": len(tasks),
        "samples_scored": sum(len(t.correct) for t in tasks),
        "samples_missing": sum(k - len(t.correct) for t in tasks),
        "pass_at_1": pass_at_1(rates) if rates else None,
        "ci95_low": ci[0] if ci else None,
        "ci95_high": ci[1] if ci else None,
    }


def build_report(
    scores: list[dict],
    samples: int | None = None,
    tasks: list[dict] | None = None,
    interval: str = "clustered",
    resamples: int = 10_000,
    seed: int = 0,
    source: str = "scores",
) -> tuple[dict, list[Problem]]:
    """The report as a JSON-able dict, and the lines that were skipped."""
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {', '.join(INTERVALS)}, got {interval!r}")
    if samples is not None and samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    problems: list[Problem] = []
    bench_tasks: dict[str, dict[str, _Task]] = defaultdict(dict)
    confidences: dict[str, list[tuple[float, bool]]] = defaultdict(list)
    judge_errors: dict[str, int] = defaultdict(int)
    truncated: dict[str, int] = defaultdict(int)  # samples that hit max_tokens
    cut_at_context: dict[str, int] = defaultdict(int)  # samples the model's context stopped first
    for i, r in enumerate(scores):
        line = r.get("_line", i + 1)
        if r["benchmark"] not in BENCHMARKS:
            problems.append(
                Problem(
                    source, line, f"benchmark must be one of {', '.join(BENCHMARKS)}, got {r['benchmark']!r}"
                )
            )
            continue
        if r.get("skipped"):
            task = bench_tasks[r["benchmark"]].setdefault(str(r["id"]), _Task())
            task.category, task.skipped = r.get("category") or task.category, True
            continue
        sample, correct = r.get("sample"), r.get("correct")
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
            problems.append(Problem(source, line, f"field 'sample' must be an integer >= 0, got {sample!r}"))
            continue
        if not isinstance(correct, bool):
            problems.append(Problem(source, line, f"field 'correct' must be true or false, got {correct!r}"))
            continue
        task = bench_tasks[r["benchmark"]].setdefault(str(r["id"]), _Task())
        task.category = r.get("category") or task.category
        if sample in task.correct:
            problems.append(
                Problem(source, line, f"sample {sample} of task {r['id']!r} repeats an earlier line")
            )
            continue
        if samples is not None and sample >= samples:
            problems.append(
                Problem(source, line, f"sample {sample} is outside 0..{samples - 1} (--samples {samples})")
            )
            continue
        task.correct[sample] = correct
        if r.get("judge_error"):
            judge_errors[r["benchmark"]] += 1
        if r.get("finish_reason") == "length":
            truncated[r["benchmark"]] += 1
        elif r.get("finish_reason") == "context":
            cut_at_context[r["benchmark"]] += 1
        if isinstance(r.get("confidence"), int | float):
            confidences[r["benchmark"]].append((float(r["confidence"]), correct))
    for t in tasks or []:  # tasks never generated or scored count as all wrong
        entry = bench_tasks[t["benchmark"]].setdefault(str(t["id"]), _Task())
        entry.category = entry.category or t.get("category", "")
        entry.skipped = entry.skipped or (bool(t.get("image")) and not entry.correct)

    report: dict = {"benchmarks": {}, "interval": interval, "skipped_lines": len(problems)}
    for bench, by_id in sorted(bench_tasks.items()):
        graded = [t for t in by_id.values() if not t.skipped]
        k = samples or max((max(t.correct) + 1 for t in graded if t.correct), default=1)
        entry = {
            "samples_per_task": k,
            **_summary(graded, k, interval, resamples, seed),
            "skipped_tasks": sum(1 for t in by_id.values() if t.skipped),
            "judge_errors": judge_errors[bench],
            "samples_truncated": truncated[bench],
            "samples_cut_at_context": cut_at_context[bench],
        }
        if confidences[bench]:
            conf, ok = zip(*confidences[bench])
            entry["calibration_error"] = calibration_error(conf, ok)
        categories = defaultdict(list)
        for t in graded:
            categories[t.category].append(t)
        if bench == "hle" or len(categories) > 1:
            entry["categories"] = {
                c or "(none)": _summary(ts, k, interval, resamples, seed)
                for c, ts in sorted(categories.items())
            }
        report["benchmarks"][bench] = entry
    return report, problems


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def _ci(s: dict) -> str:
    return "-" if s["ci95_low"] is None else f"{_pct(s['ci95_low'])}-{_pct(s['ci95_high'])}"


def print_report(report: dict, console=None) -> None:
    """One table over benchmarks, then one per benchmark with categories (HLE)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"Pass@1 with 95% interval ({report['interval']}, tasks as the unit)")
    for col in ("benchmark", "tasks", "k", "Pass@1%", "95% CI", "missing", "skipped", "calib%"):
        table.add_column(
            col, justify="left" if col == "benchmark" else "right", no_wrap=True, min_width=len(col)
        )
    for bench, e in report["benchmarks"].items():
        table.add_row(
            bench,
            str(e["tasks"]),
            str(e["samples_per_task"]),
            _pct(e["pass_at_1"]),
            _ci(e),
            str(e["samples_missing"]),
            str(e["skipped_tasks"]),
            _pct(e.get("calibration_error")),
        )
    console.print(table)
    for bench, e in report["benchmarks"].items():
        if "categories" in e:
            cats = Table(title=f"{bench} by category")
            for col in ("category", "tasks", "Pass@1%", "95% CI"):
                cats.add_column(col, justify="left" if col == "category" else "right", no_wrap=True)
            for name, s in e["categories"].items():
                cats.add_row(name, str(s["tasks"]), _pct(s["pass_at_1"]), _ci(s))
            console.print(cats)
        if e["skipped_tasks"]:
            console.print(
                f"{bench}: {e['skipped_tasks']} task(s) skipped (image input, no vision path); "
                "Pass@1 is over the other tasks"
            )
        if e["samples_truncated"]:
            console.print(f"{bench}: {e['samples_truncated']} sample(s) stopped at max_tokens")
        if e.get("samples_cut_at_context"):
            console.print(
                f"{bench}: {e['samples_cut_at_context']} sample(s) stopped at the model's context "
                "(max_model_len) before max_tokens"
            )
        if e["judge_errors"]:
            console.print(f"{bench}: {e['judge_errors']} sample(s) counted wrong because the judge failed")
    if report["skipped_lines"]:
        console.print(f"{report['skipped_lines']} malformed line(s) skipped")
    console.print(
        "missing: samples counted wrong because no scored line exists; skipped: image tasks; "
        "calib%: RMS calibration error (HLE, when confidences exist)"
    )
