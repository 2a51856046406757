"""Offline engine throughput: many requests with random prompt / output lengths (ignore_eos),
synchronous loop vs asynchronous (zero-overhead) loop on the same workload.

    uv run --no-sync python benchmarks/engine/bench_offline.py --num-requests 16

Prints a table and writes benchmarks/out/bench_offline.json (one record per loop; the async
record's speedup_vs_sync is the async gain measured in the same run). Engine flags (--model,
--max-num-seqs, ...) are accepted too; without --model it runs the built-in deepinfer-tiny.

With the model on CUDA (--device cuda or DEEPINFER_DEVICE=cuda) each record also gives the device's
idle gap before each decode step, from CUDA events (end of step N-1 -> start of step N on the stream):
idle_gap_us_median / idle_gap_us_p90 / _mean / _max, device_busy_us_median, device_idle_fraction, and
for the async loop idle_gap_median_vs_sync (its median gap / the sync loop's: the host time it hides):

    DEEPINFER_DEVICE=cuda python benchmarks/engine/bench_offline.py --num-requests 32 --output-json gap.json

On the CPU those keys are None (the CPU runs synchronously with the host: there is no device idle time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deepinfer.bench import add_bench_args, run_bench
from deepinfer.engine_args import EngineArgs

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_offline.json"


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
