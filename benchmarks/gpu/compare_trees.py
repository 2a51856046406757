"""After / before ratios of two `deepinfer bench` runs of the same configurations (run_regression.sh).

Reads `regression_{decode,prefill}_{baseline,current}[_ROUND].json` in a folder, pairs the records by phase
and size (decode: batch; prefill: chunk tokens), prints one table and writes flat records: each tree's best time
over its rounds, current / baseline (below 1: the current tree is faster), and each tree's spread over its
rounds (slowest / fastest), the noise the ratio is to be read against.

    python benchmarks/gpu/compare_trees.py RESULTS_DIR [--output regression.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# per phase: the record key that names a configuration and the time measured for it (both in ms)
KEYS = {"decode": ("batch", "ms_per_step"), "prefill": ("chunk_tokens", "chunk_latency_ms")}


def load(folder: Path, phase: str, tag: str) -> dict[int, list[dict]]:
    """Every round's record of each size (rounds: the files `regression_PHASE_TAG.json`, `..._TAG_2.json`, ...)."""
    size_key, _ = KEYS[phase]
    records: dict[int, list[dict]] = {}
    for path in sorted(folder.glob(f"regression_{phase}_{tag}*.json")):
        suffix = path.stem.removeprefix(f"regression_{phase}_{tag}")
        if suffix and not suffix.lstrip("_").isdigit():
            continue
        for r in json.loads(path.read_text()):
            if r.get("phase") == phase:
                records.setdefault(int(r[size_key]), []).append(r)
    return records


def compare(folder: Path) -> list[dict]:
    rows = []
    for phase, (size_key, time_key) in KEYS.items():
        before, after = load(folder, phase, "baseline"), load(folder, phase, "current")
        for size in sorted(before.keys() & after.keys()):
            b = [r[time_key] for r in before[size]]
            a = [r[time_key] for r in after[size]]
            rows.append(
                {
                    "phase": phase,
                    size_key: size,
                    f"baseline_{time_key}": min(b),
                    f"current_{time_key}": min(a),
                    "current_over_baseline": min(a) / min(b),
                    "baseline_rounds": len(b),
                    "current_rounds": len(a),
                    "baseline_spread": max(b) / min(b),
                    "current_spread": max(a) / min(a),
                    "device": after[size][0].get("device"),
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
    print(
        f"{'phase':8} {'size':>6} {'baseline':>10} {'current':>10} {'current/baseline':>17} "
        f"{'spread base / cur (rounds)':>27}"
    )
    for r in rows:
        size_key, time_key = KEYS[r["phase"]]
        print(
            f"{r['phase']:8} {r[size_key]:>6} {r[f'baseline_{time_key}']:>8.2f}ms "
            f"{r[f'current_{time_key}']:>8.2f}ms {r['current_over_baseline']:>17.3f} "
            f"{r['baseline_spread']:>11.3f} / {r['current_spread']:.3f} "
            f"({r['baseline_rounds']}, {r['current_rounds']})"
        )
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
