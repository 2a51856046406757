"""The `deepinfer` command: generate, bench, launch, eval.

Only argparse and the standard library load before a command runs, so `--help`, `--version` and
usage errors answer at once; torch and the model package are imported by the command that needs them.
Errors are one line on stderr with an exit status (errors.py); `--debug` / `DEEPINFER_DEBUG=1` shows
the traceback.
"""

from __future__ import annotations

import sys

from .errors import debug_requested, run_reporting
from .eval_handoff import run_deepinfer_eval

__all__ = ["main", "run_deepinfer_eval"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    if argv and argv[0] == "launch":
        from deepinfer_cluster.launch import main as launch_main

        return launch_main(argv[1:])
    if argv and argv[0] == "eval":
        return run_deepinfer_eval(argv[1:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in ("prefill", "decode", "sweep"):
        from ..bench.harness import main as harness_main

        return run_reporting(f"deepinfer bench {argv[1]}", lambda: harness_main(argv[1:]), debug)
    if argv[:2] == ["bench", "throughput"]:
        argv = ["bench"] + argv[2:]
    from .parser import build_parser

    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from .generate import cmd_generate

        return run_reporting("deepinfer generate", lambda: cmd_generate(args), debug)
    if args.command == "bench":
        from ..bench.throughput import run_bench

        return run_reporting("deepinfer bench", lambda: run_bench(args), debug)
    return 2
