#!/usr/bin/env bash
# The reference release's evaluation suite: AIME 2026 (k=32), GPQA Diamond (k=8), HLE (k=1),
# run stage by stage with deepinfer-eval. Every stage is resumable or cheap to rerun.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: eval/reference_suite.sh --model DIR --out DIR [--aime FILE] [--gpqa FILE] [--hle FILE]
                               [--judge-url URL --judge-model NAME] [--seed N] [--max-model-len N]

  --model DIR        local HF model directory for generation
  --out DIR          where tasks, generations, scores and reports go
  --aime FILE        upstream AIME 2026 file (csv / json / jsonl / parquet)
  --gpqa FILE        upstream GPQA Diamond CSV (original columns)
  --hle FILE         upstream HLE test set (parquet)
  --judge-url URL    OpenAI-compatible endpoint for the HLE judge (default: exact-match judge)
  --judge-model NAME model name at that endpoint ($OPENAI_API_KEY is sent if set)
  --seed N           generation seed (default 0)
  --max-model-len N  engine context length (default 40960: prompt + 32768 generated tokens)
Benchmarks whose file is not given are left out.
USAGE
}

model="" out="" aime="" gpqa="" hle="" judge_url="" judge_model="" seed=0 max_model_len=40960
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --aime) aime="$2"; shift 2 ;;
    --gpqa) gpqa="$2"; shift 2 ;;
    --hle) hle="$2"; shift 2 ;;
    --judge-url) judge_url="$2"; shift 2 ;;
    --judge-model) judge_model="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --max-model-len) max_model_len="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -n "$model" && -n "$out" ]] || { usage >&2; exit 2; }
mkdir -p "$out"

run() {  # run BENCHMARK UPSTREAM SAMPLES [score options...]
  local b="$1" src="$2" k="$3"; shift 3
  deepinfer-eval convert --benchmark "$b" --input "$src" --output "$out/$b-tasks.jsonl"
  deepinfer-eval generate --benchmark "$b" --tasks "$out/$b-tasks.jsonl" --samples "$k" --model "$model" \
    --seed "$seed" --engine-arg "max_model_len=$max_model_len" --output "$out/$b-gen.jsonl"
  deepinfer-eval score --generations "$out/$b-gen.jsonl" --output "$out/$b-scores.jsonl" "$@"
  deepinfer-eval report --scores "$out/$b-scores.jsonl" --tasks "$out/$b-tasks.jsonl" --samples "$k" \
    --output "$out/$b-report.json"
}

[[ -n "$aime" ]] && run aime "$aime" 32
[[ -n "$gpqa" ]] && run gpqa "$gpqa" 8
if [[ -n "$hle" ]]; then
  if [[ -n "$judge_url" ]]; then
    run hle "$hle" 1 --judge openai --judge-url "$judge_url" --judge-model "$judge_model"
  else
    run hle "$hle" 1
  fi
fi
