"""Speculative decoding through the real engine loop: drafts off, always-right drafts, the checkpoint's drafter.

    uv run --no-sync python benchmarks/spec/bench_spec_engine.py                  # random-weight tiny V4.1, CPU
    uv run --no-sync python benchmarks/spec/bench_spec_engine.py --nextn 3 --batch 8
    python3 benchmarks/spec/bench_spec_engine.py --model DIR --device cuda --prompts code --batch 1 \\
        --prompt-len 128 --max-tokens 256 --nextn 3                                # a trained checkpoint, GPU

Configurations (greedy decoding, same prompts, same engine settings, measured in one run):
  none    drafts off: the baseline every ratio is measured against;
  oracle  `RecordedDrafter`: proposes the continuation `none` produced, at no model cost, so every draft
          is right: the mechanism's ceiling in steps and in tokens/s (the verification step's own cost
          and the loop it runs in, with nothing spent on drafting);
  model   the checkpoint's own DSpark draft blocks (`PagedDrafter`, from the runner's cached drafter keys).
          With the built-in random-weight checkpoint the drafter is untrained: acceptance ~0, the cost of
          drafting only.

Prompts: `ids` (default) are fixed token-id patterns; `code` are the first --prompt-len tokens of this
repository's Python sources (text of the kind deepinfer-tiny was trained on, where a trained drafter is
right as often as it can be). Each configuration gets its own engine, serves the workload once to warm
up (first-step allocations, CUDA graph captures, and the draft policy's first measurements), then
--repeats timed times; the fastest run is kept. Columns: tokens_per_request_step = emitted tokens per
sequence per decode step (1 + accepted); tok_per_s = generated tokens / wall time; tok_per_s_per_user =
that / --batch; speedup_* = ratio to `none` in the same run. On the CPU, verifying 1 + k rows costs more
than one decode row, unlike a GPU decode step bound by its launches or memory traffic: there the step
count and tokens per step are the portable numbers. Prints a table and writes one flat JSON record per
configuration to --out (default benchmarks/out/, untracked).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from deepinfer import SamplingParams
from deepinfer.engine.drafting import RecordedDrafter
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "out" / "bench_spec_engine.json"
CONFIGS = ("none", "oracle", "model")


def make_prompts(engine: LLMEngine, args) -> list[list[int]]:
    if args.prompts == "ids":
        return [[(17 * i + 7 * j) % 256 for j in range(args.prompt_len)] for i in range(args.batch)]
    prompts = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        ids = engine.tokenizer.encode(path.read_text(), add_special_tokens=False).ids
        if max(ids, default=0) >= engine.vocab_size:
            raise SystemExit(f"--prompts code: {args.model} has a tokenizer larger than its vocabulary")
        if len(ids) >= args.prompt_len:
            prompts.append(ids[: args.prompt_len])
        if len(prompts) == args.batch:
            return prompts
    raise SystemExit(f"--prompts code: fewer than {args.batch} source files of {args.prompt_len} tokens")


def build(path: Path, name: str, args) -> LLMEngine:
    kw = dict(model=str(path), max_model_len=args.prompt_len + args.max_tokens + args.nextn + 64)
    if args.device:
        kw["device"] = args.device
    if args.block_size:
        kw["block_size"] = args.block_size
    return LLMEngine(EngineArgs(**kw), num_speculative_tokens=0 if name == "none" else args.nextn)


def serve(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    outs = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    wall = time.perf_counter() - start
    return [list(outs[str(i)].outputs[0].token_ids) for i in range(len(prompts))], wall


def run_config(path: Path, name: str, args, recorded: list[list[int]] | None) -> dict:
    engine = build(path, name, args)
    try:
        prompts = make_prompts(engine, args)
        if name == "oracle":
            full = [p + t for p, t in zip(prompts, recorded)]
            engine.spec.drafter = RecordedDrafter(full, engine.vocab_size, confidence=1.0)
        serve(engine, prompts, args.max_tokens)  # warm-up
        best = None
        for _ in range(args.repeats):
            steps0, draft0 = engine.stats.steps, engine.stats.draft_s
            tokens, wall = serve(engine, prompts, args.max_tokens)
            if best is None or wall < best[1]:
                best = (tokens, wall, engine.stats.steps - steps0, engine.stats.draft_s - draft0)
        s = engine.spec_stats() or {}
    finally:
        engine.close()
    tokens, wall, steps, draft_s = best
    generated = sum(len(t) for t in tokens)
    return {
        "config": name,
        "nextn": 0 if name == "none" else args.nextn,
        "batch": args.batch,
        "prompts": args.prompts,
        "device": str(engine.device),
        "steps": steps,
        "generated_tokens": generated,
        "accept_rate": s.get("avg_accept_rate", 0.0),
        "avg_accepted_len": s.get("avg_accepted_len", 0.0),
        "avg_verified_len": s.get("avg_verified_len", 0.0),
        "tokens_per_request_step": s.get("tokens_per_request_step", 1.0),
        "wall_s": wall,
        "draft_s": draft_s,
        "tok_per_s": generated / wall,
        "tok_per_s_per_user": generated / wall / args.batch,
        "tokens": tokens,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, default=None, help="checkpoint (default: a random-weight tiny V4.1)"
    )
    ap.add_argument("--device", default=None, help="cpu, cuda or auto (default: the engine's)")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    ap.add_argument("--prompts", choices=("ids", "code"), default="ids")
    ap.add_argument("--nextn", type=int, default=5, help="drafts per step (the reference's default: 5)")
    ap.add_argument("--batch", type=int, default=4, help="requests served at once")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per configuration (fastest kept)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if not configs or configs[0] != "none" or any(c not in CONFIGS for c in configs):
        raise SystemExit(
            f"--configs must start with none and name only {', '.join(CONFIGS)}, got {args.configs!r}"
        )
    for name in ("nextn", "batch", "prompt_len", "max_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = make_v41_checkpoint(Path(tmp) / "v41-tiny", seed=0)
            args.block_size = args.block_size or 16
        records = []
        for name in tqdm(configs, desc="configurations"):
            recorded = records[0]["tokens"] if records else None
            records.append(run_config(args.model, name, args, recorded))
    base = records[0]
    for r in records:
        r["same_tokens_as_none"] = r["tokens"] == base["tokens"]
        r["speedup_steps"] = base["steps"] / r["steps"]
        r["speedup_tok_per_s"] = r["tok_per_s"] / base["tok_per_s"]
    for r in records:
        r.pop("tokens")
    table = Table(
        title=f"engine speculative decoding: {args.model.name}, {records[0]['device']}, batch {args.batch}, "
        f"{args.prompts} prompts of {args.prompt_len} tokens, {args.max_tokens} output tokens"
    )
    cols = [
        "config", "nextn", "steps", "accept_rate", "tokens_per_request_step", "tok_per_s", "tok_per_s_per_user",
        "draft_s", "speedup_steps", "speedup_tok_per_s", "same_tokens_as_none",
    ]  # fmt: skip
    for c in cols:
        table.add_column(c)
    for r in records:
        table.add_row(*(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    console = Console(width=220)
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
