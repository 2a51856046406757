"""How long the `deepinfer` command takes to answer when it loads no model: --help, a subcommand's help,
--version, usage errors, and the checks that run before the model loads.

Each case runs `python -m deepinfer.cli ...` in a fresh subprocess (`--repeats` times, after one untimed
warm-up that fills the OS file cache) and reports the median wall time. The goal for help, version and
usage errors is under 1 s (`--goal-ms`): they import neither torch nor the model package. The sampling
flag checks build a SamplingParams, whose rules (`deepinfer_model.sampling.params`) are plain Python the
model package exports lazily: they are held to the same goal. In-run baseline: `python -c pass` (the interpreter's own
start). Prints a table and writes benchmarks/out/cli_startup.json (flat records, `ms_per_call`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "out" / "cli_startup.json"

# (name, argv after `python -m deepinfer.cli`, expected exit status, held to the goal)
CASES = [
    ("help", ["--help"], 0, True),
    ("generate_help", ["generate", "--help"], 0, True),
    ("bench_help", ["bench", "--help"], 0, True),
    ("bench_decode_help", ["bench", "decode", "--help"], 0, True),
    ("version", ["--version"], 0, True),
    ("usage_error_no_command", [], 2, True),
    ("usage_error_no_prompt", ["generate"], 2, True),
    ("usage_error_bad_int", ["generate", "--prompt", "x", "--max-tokens", "many"], 2, True),
    ("missing_input", ["generate", "--input", "/nonexistent/in.jsonl"], 2, True),
    ("missing_model", ["generate", "--prompt", "x", "--model", "/nonexistent/model"], 2, True),
    ("bad_output_dir", ["generate", "--prompt", "x", "--output", "/nonexistent/out.jsonl"], 2, True),
    ("bad_top_p", ["generate", "--prompt", "x", "--top-p", "0"], 2, True),
    ("bad_temperature", ["generate", "--prompt", "x", "--temperature", "-1"], 2, True),
    ("bad_max_tokens", ["generate", "--prompt", "x", "--max-tokens", "-1"], 2, True),
    ("bad_n", ["generate", "--prompt", "x", "--n", "0"], 2, True),
]


def time_call(argv: list[str], expected: int) -> float:
    t0 = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - t0
    if run.returncode != expected:
        raise SystemExit(f"{argv}: exit status {run.returncode}, expected {expected}\n{run.stderr}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (default: %(default)s)")
    p.add_argument("--goal-ms", type=float, default=1000.0, help="goal per call (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON results (default: benchmarks/out/)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    from rich.console import Console
    from rich.table import Table

    cases = [("python_baseline", None, 0, False), *CASES]
    records = []
    for name, cli_args, expected, goal in cases:
        cmd = (
            [sys.executable, "-c", "pass"]
            if cli_args is None
            else [sys.executable, "-m", "deepinfer.cli", *cli_args]
        )
        time_call(cmd, expected)  # warm-up: the OS file cache, .pyc files
        times = [time_call(cmd, expected) for _ in range(args.repeats)]
        ms = statistics.median(times) * 1e3
        records.append(
            {
                "case": name,
                "argv": " ".join(cli_args or ["-c", "pass"]),
                "ms_per_call": round(ms, 1),
                "ms_min": round(min(times) * 1e3, 1),
                "repeats": args.repeats,
                "goal_ms": args.goal_ms if goal else None,
                "meets_goal": (ms <= args.goal_ms) if goal else None,
            }
        )
    table = Table(title="deepinfer command startup (median of fresh subprocesses)")
    for col in ("case", "ms/call", "min ms", "goal"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in records:
        goal = "-" if r["goal_ms"] is None else ("met" if r["meets_goal"] else "MISSED")
        table.add_row(r["case"], f"{r['ms_per_call']:.0f}", f"{r['ms_min']:.0f}", goal)
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["meets_goal"] is not False for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
