"""Engine-level YoCo prefill truncation: off / mask / compact through `LLMEngine` on the CPU tiny V4.1.

Writes a random quantised §11 checkpoint (max_position_embeddings raised to fit the longest prompt), then
for each prompt length and mode runs one engine (paged runner, chunked prefill with
--max-num-batched-tokens per step) over --num-requests prompts with `max_tokens` = --gen-tokens, and
reports prefill tokens/s (prompt tokens / time of the steps up to the last first token), total wall
time and the engine's `EngineStats.prefill_flops` estimate. Ratios are against `off` at the same length
in the same run. Writes benchmarks/out/bench_yoco_engine.json (one flat record per configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from deepinfer import SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint, tiny_v41_config_dict
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_yoco_engine.json"
MODES = ("off", "mask", "compact")


def run_engine(path: Path, mode: str, keep: int, prompts: list[list[int]], args) -> dict:
    os.environ["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"] = mode
    os.environ["DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"] = str(keep if mode != "off" else 0)
    max_len = max(len(p) for p in prompts) + args.gen_tokens + 1
    engine = LLMEngine(
        EngineArgs(
            model=str(path),
            block_size=64,
            max_model_len=max_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=False,
            disable_log_stats=True,
        )
    )
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    for j, p in enumerate(prompts):
        engine.add_request(str(j), None, params, prompt_token_ids=p)
    t0 = time.perf_counter()
    prefill_s = None
    while engine.has_unfinished_requests():
        engine.step()
        if prefill_s is None and all(s.num_generated > 0 for s in engine.seqs.values()) and engine.seqs:
            prefill_s = time.perf_counter() - t0
    total_s = time.perf_counter() - t0
    engine.close()
    n_prompt = sum(len(p) for p in prompts)
    prefill_s = prefill_s if prefill_s is not None else total_s
    return {
        "prefill_s": prefill_s,
        "total_s": total_s,
        "prefill_tok_per_s": n_prompt / prefill_s,
        "prefill_gflops_est": engine.stats.prefill_flops / 1e9,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 1024], help="prompt lengths")
    p.add_argument("--num-requests", type=int, default=2, help="prompts per configuration")
    p.add_argument("--gen-tokens", type=int, default=2, help="generated tokens per request")
    p.add_argument(
        "--keep", type=int, default=14, help="KEEP (>= W + B = 8 + 1 on the tiny config, no drafts)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = tiny_v41_config_dict()
    cfg["text_config"]["max_position_embeddings"] = max(256, max(args.prompt_lens) + args.gen_tokens + 1)
    records = []
    saved = {
        k: os.environ.get(k)
        for k in ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS")
    }
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = make_v41_checkpoint(tmp, cfg, seed=0)
            jobs = [(n, m) for n in args.prompt_lens for m in MODES]
            base: dict[int, dict] = {}
            for n, mode in tqdm(jobs, desc="engine runs"):
                g = torch.Generator().manual_seed(n)
                prompts = [
                    torch.randint(4, 256, (n,), generator=g).tolist() for _ in range(args.num_requests)
                ]
                r = run_engine(path, mode, args.keep, prompts, args)
                base.setdefault(n, r)
                records.append(
                    {
                        "prompt_len": n,
                        "mode": mode,
                        "keep_tokens": args.keep if mode != "off" else 0,
                        "num_requests": args.num_requests,
                        "max_num_batched_tokens": args.max_num_batched_tokens,
                        **r,
                        "prefill_speedup_vs_off": r["prefill_tok_per_s"] / base[n]["prefill_tok_per_s"],
                        "flops_ratio_vs_off": r["prefill_gflops_est"] / base[n]["prefill_gflops_est"],
                    }
                )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    table = Table(title=f"YoCo truncation through LLMEngine (CPU tiny V4.1, KEEP = {args.keep})")
    for col in ("prompt", "mode", "prefill tok/s", "x off", "est. GFLOP", "FLOP ratio", "total s"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            str(r["prompt_len"]),
            r["mode"],
            f"{r['prefill_tok_per_s']:.0f}",
            f"{r['prefill_speedup_vs_off']:.2f}",
            f"{r['prefill_gflops_est']:.2f}",
            f"{r['flops_ratio_vs_off']:.3f}",
            f"{r['total_s']:.2f}",
        )
    Console().print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
