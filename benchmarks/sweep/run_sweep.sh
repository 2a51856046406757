#!/usr/bin/env bash
# Full benchmark grid: `deepinfer bench prefill` once per cached-context length and `deepinfer bench
# decode` once per nextn, each writing its JSON rows and Pareto PNG to the results directory; the rows
# are then merged into <results-dir>/run_sweep.json (one flat record per configuration).
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: benchmarks/sweep/run_sweep.sh [--contexts LIST] [--nextn-values LIST] [--results-dir DIR] [-- BENCH ARGS...]

  --contexts LIST      cached context before each prefill chunk, comma list (default: 0)
  --nextn-values LIST  draft tokens per decode step, comma list (default: 0)
  --results-dir DIR    where JSON / PNGs go (default: benchmarks/out, untracked)
  BENCH ARGS           passed to every `deepinfer bench prefill|decode` call, e.g.
                       --chunks 4096,8192,16384,32768,65536 --batches 8,16,32,64,128,256 (GPU defaults)
                       --chunks 16,32,64,128 --batches 1,2,4,8 --num-threads 1 (CPU defaults)

Environment: PYTHON (default .venv/bin/python). `deepinfer bench sweep` runs both phases in one run.
USAGE
}

contexts="0"
nextns="0"
results="benchmarks/out"
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --contexts) contexts="$2"; shift 2 ;;
        --nextn-values) nextns="$2"; shift 2 ;;
        --results-dir) results="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "run_sweep.sh: unknown option $1 (bench arguments go after --)" >&2; usage >&2; exit 2 ;;
    esac
done
py="${PYTHON:-.venv/bin/python}"
names=()
for c in ${contexts//,/ }; do
    "$py" -m deepinfer.cli bench prefill --prefill-context "$c" --results-dir "$results" \
        --name "run_sweep_prefill_ctx$c" "$@"
    names+=("run_sweep_prefill_ctx$c")
done
for n in ${nextns//,/ }; do
    "$py" -m deepinfer.cli bench decode --nextn "$n" --results-dir "$results" \
        --name "run_sweep_decode_nextn$n" "$@"
    names+=("run_sweep_decode_nextn$n")
done
"$py" - "$results" "${names[@]}" <<'PY'
import json, sys
from pathlib import Path
results, names = Path(sys.argv[1]), sys.argv[2:]
rows = [dict(r, run=name) for name in names for r in json.loads((results / f"{name}.json").read_text())]
(results / "run_sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
print(f"wrote {results / 'run_sweep.json'} ({len(rows)} rows from {len(names)} runs)")
PY
