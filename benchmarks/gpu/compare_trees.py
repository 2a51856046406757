"""After / before ratios of two `deepinfer bench` runs of the same configurations (run_regression.sh).

Reads `regression_{decode,prefill}_{baseline,current}.json` in a folder, pairs the records by phase and size
(decode: batch; prefill: chunk tokens), prints one table and writes flat records: the time of each tree and
current / baseline (below 1: the current tree is faster).

    python benchmarks/gpu/compare_trees.py RESULTS_DIR [--output regression.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# per phase: the record key that names a configuration and the time measured for it (both in ms)
KEYS = {"decode": ("batch", "ms_per_step"), "prefill": ("chunk_tokens", "chunk_latency_ms")}


def load(folder: Path, phase: str, tag: str) -> dict[int, dict]:
    path = folder / f"regression_{phase}_{tag}.json"
    if not path.exists():
        return {}
    size_key, _ = KEYS[phase]
    return {int(r[size_key]): r for r in json.loads(path.read_text()) if r.get("phase") == phase}


def compare(folder: Path) -> list[dict]:
    rows = []
    for phase, (size_key, time_key) in KEYS.items():
        before, after = load(folder, phase, "baseline"), load(folder, phase, "current")
        for size in sorted(before.keys() & after.keys()):
            b, a = before[size][time_key], after[size][time_key]
            rows.append(
                {
                    "phase": phase,
                    size_key: size,
                    f"baseline_{time_key}": b,
                    f"current_{time_key}": a,
                    "current_over_baseline": a / b,
                    "device": after[size].get("device"),
                }
            )
        missing = sorted(before.keys() ^ after.keys())
        if missing:
            print(f"{phase}: sizes measured in one tree only: {missing}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="where run_regression.sh wrote the bench results")
    ap.add_argument("--output", type=Path, help="write the paired records here (JSON list)")
    args = ap.parse_args()
    rows = compare(args.folder)
    print(f"{'phase':8} {'size':>6} {'baseline':>10} {'current':>10} {'current/baseline':>17}")
    for r in rows:
        size_key, time_key = KEYS[r["phase"]]
        print(
            f"{r['phase']:8} {r[size_key]:>6} {r[f'baseline_{time_key}']:>8.2f}ms "
            f"{r[f'current_{time_key}']:>8.2f}ms {r['current_over_baseline']:>17.3f}"
        )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
