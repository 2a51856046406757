"""Offline engine throughput: many requests with random prompt / output lengths (ignore_eos),
synchronous loop vs asynchronous (zero-overhead) loop on the same workload.

    uv run --no-sync python benchmarks/engine/bench_offline.py --num-requests 16

Prints a table and writes benchmarks/results/bench_offline.json (one record per loop; the async
record's speedup_vs_sync is the async gain measured in the same run). Engine flags (--model,
--max-num-seqs, ...) are accepted too; without --model it runs the built-in deepinfer-tiny.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deepinfer.bench import add_bench_args, run_bench
from deepinfer.engine_args import EngineArgs

RESULTS = Path(__file__).resolve().parents[1] / "results" / "bench_offline.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_args(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(output_json=RESULTS)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
