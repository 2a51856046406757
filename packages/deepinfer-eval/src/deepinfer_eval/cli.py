"""``deepinfer-eval``: convert / generate / score / report, each a separate stage."""

from __future__ import annotations

import argparse
import json
import os
import sys

from deepinfer_eval.convert import BENCHMARKS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer-eval",
        description="AIME / HLE / GPQA Diamond evaluation: convert, generate, score and report as separate stages.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="upstream CSV / JSON / JSONL / parquet -> task JSONL")
    c.add_argument("--benchmark", choices=BENCHMARKS, required=True)
    c.add_argument("--input", required=True, help="upstream file (.csv, .json, .jsonl, .parquet)")
    c.add_argument("--output", required=True, help="task JSONL to write")

    g = sub.add_parser("generate", help="sample K responses per task with the engine (resumable)")
    g.add_argument("--benchmark", choices=BENCHMARKS, required=True)
    g.add_argument("--tasks", required=True, help="task JSONL from 'convert'")
    g.add_argument("--samples", type=int, required=True, help="samples per task (k)")
    g.add_argument("--model", help="local HF model directory (default: the engine's default model)")
    g.add_argument("--output", required=True, help="generation JSONL; existing samples are kept and skipped")
    g.add_argument("--seed", type=int, default=0, help="base of request seeds and GPQA option shuffles")
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--max-tokens", type=int, default=32768)
    g.add_argument("--batch-size", type=int, default=64, help="requests handed to the engine at once")
    g.add_argument(
        "--skip-image-tasks",
        action="store_true",
        help="record HLE image tasks as skipped instead of sending their image (a model without vision)",
    )
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to deepinfer.LLM (repeatable; VALUE parsed as JSON if it can be), "
        "e.g. --engine-arg max_model_len=40960",
    )

    s = sub.add_parser("score", help="generations -> one scored line per sample")
    s.add_argument("--generations", required=True)
    s.add_argument("--output", required=True)
    s.add_argument(
        "--judge",
        choices=("exact", "openai", "engine"),
        default="exact",
        help="HLE judge: exact match (built in), an OpenAI-compatible endpoint, or our engine",
    )
    s.add_argument("--judge-url", help="base URL of the endpoint, e.g. http://127.0.0.1:8000/v1")
    s.add_argument("--judge-model", help="model name at the endpoint, or model directory for --judge engine")
    s.add_argument(
        "--judge-api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the endpoint's API key (optional)",
    )
    s.add_argument("--judge-workers", type=int, default=8, help="parallel calls to the endpoint")
    s.add_argument("--judge-timeout", type=float, default=600.0, help="seconds per endpoint call")
    s.add_argument(
        "--judge-retries",
        type=int,
        default=2,
        help="retries of a call that failed with 429 / 5xx / a connection error (backoff 2, 4, ... s)",
    )
    s.add_argument("--judge-cache", help="judge reply cache (default: <output>.judge-cache.jsonl)")
    s.add_argument(
        "--aime-boxed",
        choices=("last", "all"),
        default="last",
        help="AIME: grade the last \\boxed{} (reference convention) or every box as a set (hedges wrong)",
    )
    s.add_argument(
        "--gpqa-ignore-case",
        action="store_true",
        help="GPQA: upper-case the extracted letter (lenient; simple-evals compares case-sensitively)",
    )
    s.add_argument(
        "--hle-accept-hedged",
        action="store_true",
        help="HLE exact judge: grade 'Answer: B or C' on its first letter (lenient; the HLE criteria reject it)",
    )

    r = sub.add_parser("report", help="Pass@1 with a 95%% interval; a table and JSON")
    r.add_argument("--scores", required=True)
    r.add_argument("--output", help="write the report JSON here (default: print it after the table)")
    r.add_argument("--samples", type=int, help="k; default: the most samples any task has")
    r.add_argument("--tasks", help="task JSONL: tasks with no scored samples count as wrong")
    r.add_argument("--interval", choices=("clustered", "bootstrap"), default="clustered")
    r.add_argument("--bootstrap-resamples", type=int, default=10_000)
    r.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    return p


def _warn(problems) -> None:
    from deepinfer_eval.records import report_problems

    report_problems(problems)


def cmd_convert(a) -> int:
    from deepinfer_eval.convert import convert_file
    from deepinfer_eval.records import write_jsonl

    tasks, problems = convert_file(a.benchmark, a.input)
    _warn(problems)
    n = write_jsonl(a.output, tasks)
    print(f"wrote {n} {a.benchmark} task(s) to {a.output}; skipped {len(problems)} row(s)", file=sys.stderr)
    return 0


def parse_engine_args(items: list[str]) -> dict:
    """["max_model_len=40960", "tokenizer=/x"] -> {"max_model_len": 40960, "tokenizer": "/x"}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--engine-arg must be KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def cmd_generate(a) -> int:
    from deepinfer_eval.convert import read_tasks
    from deepinfer_eval.generate import EngineGenerator, SamplingConfig, run_generation

    tasks, problems = read_tasks(a.tasks, a.benchmark)
    _warn(problems)
    sampling = SamplingConfig(a.temperature, a.top_p, a.max_tokens)
    generator = EngineGenerator(a.model, sampling, **parse_engine_args(a.engine_arg))
    try:
        summary = run_generation(
            tasks,
            generator,
            a.output,
            a.samples,
            a.seed,
            a.batch_size,
            sampling,
            skip_image_tasks=a.skip_image_tasks,
        )
    finally:
        generator.close()
    _warn(summary.problems)
    for warning in summary.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"wrote {summary.written} sample(s) ({summary.failed} failed requests, scored wrong); "
        f"{summary.already_done} already done; "
        f"{summary.image_tasks} image task(s) sent with their image, "
        f"{summary.image_tasks_skipped} skipped (--skip-image-tasks)",
        file=sys.stderr,
    )
    return 0


def _judge(a):
    from deepinfer_eval.judges import ExactMatchJudge, GeneratorBackend, HttpChatBackend, JudgeCache, LLMJudge

    if a.judge == "exact":
        return ExactMatchJudge(accept_hedged=a.hle_accept_hedged)
    if not a.judge_model:
        raise ValueError(f"--judge {a.judge} needs --judge-model")
    cache = JudgeCache(a.judge_cache or f"{a.output}.judge-cache.jsonl")
    if a.judge == "openai":
        if not a.judge_url:
            raise ValueError("--judge openai needs --judge-url")
        backend = HttpChatBackend(
            a.judge_url,
            a.judge_model,
            os.environ.get(a.judge_api_key_env),
            timeout_s=a.judge_timeout,
            retries=a.judge_retries,
            workers=a.judge_workers,
        )
        return LLMJudge(backend, cache)
    from deepinfer_eval.generate import EngineGenerator, SamplingConfig

    generator = EngineGenerator(a.judge_model, SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=8192))
    return LLMJudge(GeneratorBackend(generator, a.judge_model), cache)


def cmd_score(a) -> int:
    from deepinfer_eval.records import read_jsonl, write_jsonl
    from deepinfer_eval.score import GENERATION_FIELDS, score_records

    data = read_jsonl(a.generations, required=GENERATION_FIELDS)
    _warn(data.problems)
    judge = _judge(a)
    scored, summary = score_records(
        data.records,
        judge,
        source=a.generations,
        aime_boxed=a.aime_boxed,
        gpqa_ignore_case=a.gpqa_ignore_case,
    )
    _warn(summary.problems)
    write_jsonl(a.output, scored)
    calls = f"; {judge.calls} judge call(s)" if hasattr(judge, "calls") else ""
    print(
        f"scored {summary.scored} sample(s) to {a.output}; {summary.skipped_tasks} skipped task(s); "
        f"{len(data.problems) + len(summary.problems)} malformed line(s); "
        f"{summary.judge_errors} judge error(s){calls}",
        file=sys.stderr,
    )
    return 0


def cmd_report(a) -> int:
    from deepinfer_eval.convert import read_tasks
    from deepinfer_eval.records import read_jsonl
    from deepinfer_eval.report import build_report, print_report

    data = read_jsonl(a.scores, required=("benchmark", "id"))
    _warn(data.problems)
    tasks = None
    if a.tasks:
        tasks, task_problems = read_tasks(a.tasks)
        _warn(task_problems)
    report, problems = build_report(
        data.records, a.samples, tasks, a.interval, a.bootstrap_resamples, a.seed, source=a.scores
    )
    _warn(problems)
    report["skipped_lines"] += len(data.problems)
    print_report(report)
    text = json.dumps(report, indent=2)
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


_COMMANDS = {"convert": cmd_convert, "generate": cmd_generate, "score": cmd_score, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, OSError, ImportError) as e:  # ImportError: the engine (an extra) is not installed
        print(f"deepinfer-eval {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
