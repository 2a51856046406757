"""KV cache tier: long shared prefixes revisited after the device prefix cache has evicted them.

A few long prefixes (few-shot prompts, conversation histories), each visited `--rounds` times with a new
short suffix, the visits cycling through the prefixes so that by a prefix's next visit the device cache,
sized for about one of them, has evicted it. The same workload runs on fresh engines: without a tier, with a
host tier, and with a one-block host tier over a disk tier (a temporary directory), so most hits come from
disk. Per configuration: prompt tokens computed, TTFT (first visits and revisits), wall time and
throughput, hit rates per tier (device / host / disk, of all prompt tokens admitted), seconds spent storing
and loading, and whether every output equals the no-tier run's.

    uv run --no-sync python benchmarks/engine/bench_kv_tier.py --prefix-len 512 --num-prefixes 3

Prints a table and writes benchmarks/out/bench_kv_tier.json (one flat record per configuration). Engine
flags (--model, --block-size, --device, ...) are accepted too; without --model it runs the built-in
deepinfer-tiny. `--num-kv-blocks` defaults to the blocks of one prefix plus one request's worth.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from deepinfer import SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from report import print_and_write

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_kv_tier.json"


def workload(args, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(10, vocab, args.prefix_len).tolist() for _ in range(args.num_prefixes)]
    return [
        p + rng.integers(10, vocab, args.suffix_len).tolist() for _ in range(args.rounds) for p in prefixes
    ]


def run(engine_args: EngineArgs, prompts: list[list[int]], max_tokens: int, first_visits: int) -> dict:
    engine = LLMEngine(engine_args, num_speculative_tokens=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs, ttft = {}, {}
    t0 = time.perf_counter()
    for j, prompt in enumerate(prompts):  # one visit at a time: a conversation's next turn
        engine.add_request(str(j), None, params, prompt_token_ids=prompt)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outputs[j] = [list(c.token_ids) for c in o.outputs]
                ttft[j] = o.metrics.ttft
    wall = time.perf_counter() - t0
    engine.close()
    st = engine.scheduler_stats()
    tier = engine.kv_tier_stats() or {}
    bs = engine_args.block_size
    query = st["prefix_cache_query_tokens"] or 1
    out_tokens = sum(len(t) for o in outputs.values() for t in o)
    revisit = [ttft[j] for j in range(first_visits, len(prompts))]
    return dict(
        outputs=outputs,
        prompt_tokens_computed=st["prefix_cache_query_tokens"]
        - st["prefix_cache_hit_tokens"]
        - st["tier_hit_tokens"],
        prompt_tokens=sum(len(p) for p in prompts),
        ttft_first_visit_ms=1e3 * statistics.mean(ttft[j] for j in range(first_visits)),
        ttft_revisit_ms=1e3 * statistics.mean(revisit) if revisit else None,
        ttft_revisit_p50_ms=1e3 * statistics.median(revisit) if revisit else None,
        wall_s=wall,
        output_tok_per_s=out_tokens / wall,
        total_tok_per_s=(sum(len(p) for p in prompts) + out_tokens) / wall,
        device_hit_rate=st["prefix_cache_hit_tokens"] / query,
        host_hit_rate=tier.get("host_hits", 0) * bs / query,
        disk_hit_rate=tier.get("disk_hits", 0) * bs / query,
        evicted_blocks=st["num_evicted_blocks"],
        tier_store_s=tier.get("store_s", 0.0),
        tier_load_s=tier.get("load_s", 0.0),
        tier_blocks_demoted=tier.get("demoted", 0),
        tier_failed_loads=tier.get("failed_loads", 0),
        host_bytes_used=tier.get("host_bytes_used", 0),
        disk_bytes_used=tier.get("disk_bytes_used", 0),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prefixes", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens of each shared prefix")
    parser.add_argument("--suffix-len", type=int, default=8, help="new tokens of each visit")
    parser.add_argument("--rounds", type=int, default=3, help="visits of each prefix")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens of each visit")
    parser.add_argument("--host-tier-bytes", type=int, default=1 << 30)
    parser.add_argument("--disk-tier-bytes", type=int, default=1 << 32)
    parser.add_argument("--bench-seed", dest="seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=RESULTS)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    for name in ("num_prefixes", "prefix_len", "suffix_len", "rounds", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    base = {k: v for k, v in vars(args).items() if k in fields}
    visit_len = args.prefix_len + args.suffix_len + args.max_tokens
    base["max_model_len"] = base["max_model_len"] or visit_len + args.block_size
    if base["num_kv_blocks"] is None:  # about one prefix on the device: a revisit finds its prefix evicted
        per_visit = -(-base["max_model_len"] // args.block_size)
        base["num_kv_blocks"] = per_visit + 2
    base["max_num_seqs"] = min(base["max_num_seqs"], 4)
    warm = LLMEngine(EngineArgs(**base), num_speculative_tokens=0)
    prompts = workload(args, warm.vocab_size)
    # one visit first, so that no configuration pays the process's first-step costs
    warm.add_request("warm-up", None, SamplingParams(max_tokens=1), prompt_token_ids=prompts[0])
    while warm.has_unfinished_requests():
        warm.step()
    warm.close()
    del warm
    records = []
    with tempfile.TemporaryDirectory(prefix="deepinfer-kv-tier-") as disk:
        configs = {
            "no_tier": dict(kv_host_tier_bytes=0, kv_disk_tier_bytes=0),
            "host": dict(kv_host_tier_bytes=args.host_tier_bytes, kv_disk_tier_bytes=0),
            "disk": dict(
                kv_host_tier_bytes=1, kv_disk_tier_bytes=args.disk_tier_bytes, kv_disk_tier_dir=disk
            ),
        }
        reference = None
        for name, tier in configs.items():
            result = run(EngineArgs(**(base | tier)), prompts, args.max_tokens, args.num_prefixes)
            outputs = result.pop("outputs")
            if reference is None:
                reference = outputs
            records.append(
                dict(
                    config=name,
                    outputs_equal_to_no_tier=outputs == reference,
                    num_kv_blocks=base["num_kv_blocks"],
                    block_size=args.block_size,
                    prefix_len=args.prefix_len,
                    num_prefixes=args.num_prefixes,
                    rounds=args.rounds,
                    **{k: tier.get(k, 0) for k in ("kv_host_tier_bytes", "kv_disk_tier_bytes")},
                    **result,
                )
            )
    plain = records[0]
    for r in records:
        r["revisit_ttft_speedup"] = (
            plain["ttft_revisit_ms"] / r["ttft_revisit_ms"] if r["ttft_revisit_ms"] else None
        )
    cols = [
        ("config", "{}"),
        ("prompt_tokens_computed", "{}"),
        ("ttft_first_visit_ms", "{:.1f}"),
        ("ttft_revisit_ms", "{:.1f}"),
        ("revisit_ttft_speedup", "{:.2f}"),
        ("total_tok_per_s", "{:.1f}"),
        ("device_hit_rate", "{:.3f}"),
        ("host_hit_rate", "{:.3f}"),
        ("disk_hit_rate", "{:.3f}"),
        ("tier_load_s", "{:.3f}"),
        ("tier_store_s", "{:.3f}"),
        ("outputs_equal_to_no_tier", "{}"),
    ]
    print_and_write(records, cols, args.output_json)
    return 0 if all(r["outputs_equal_to_no_tier"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
