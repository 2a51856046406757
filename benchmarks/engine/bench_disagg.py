"""Prefill / decode disaggregation vs one NORMAL engine under a mixed workload, in the same run.

The workload mixes requests with long prompts and short outputs and requests with short prompts and long
outputs, all submitted at once. In one engine the long prefills share steps with the decodes (chunked
prefill), so decoding requests stall while a long prompt is prefilled; disaggregated, a PROMPT engine
process prefills while a COMPLETION engine process decodes. Per configuration: TTFT (arrival to the first
output token) and inter-token latency percentiles (each token's gap to the previous one: a report that
shows k new tokens of a request counts its gap / k, k times; reports are the front's record of the decode
engine's per-step progress, or the driver's view after every step of the one engine),
wall time, output throughput, and whether every output equals the NORMAL engine's (greedy).

    uv run --no-sync python benchmarks/engine/bench_disagg.py --num-long-prompts 4 --long-prompt-len 512

Prints a table and writes one flat JSON record per configuration to --output-json. Engine flags
(--model, --block-size, --num-kv-blocks, ...) are accepted too; without --model it runs the built-in
deepinfer-tiny. Process start-up is not timed: each configuration serves one warm-up request first.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
from deepinfer import SamplingParams
from deepinfer.engine.disaggregated import DisaggregatedEngine
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from report import print_and_write

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_disagg.json"


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs, the two kinds interleaved."""
    rng = np.random.default_rng(args.seed)
    longs = [
        (rng.integers(10, vocab, args.long_prompt_len).tolist(), args.short_output_tokens)
        for _ in range(args.num_long_prompts)
    ]
    shorts = [
        (rng.integers(10, vocab, args.short_prompt_len).tolist(), args.long_output_tokens)
        for _ in range(args.num_long_outputs)
    ]
    mixed = []
    for i in range(max(len(longs), len(shorts))):
        mixed += shorts[i : i + 1] + longs[i : i + 1]
    return mixed


def drive(engine, requests: list[tuple[list[int], int]], tag: str) -> dict:
    """Submit every request at once and step until all finish. Token times: the front's record of when
    each decode report arrived (disaggregated), else the driver's view after every step."""
    split = isinstance(engine, DisaggregatedEngine)
    if split:
        engine.record_token_times, engine.token_times = True, {}
    outputs, ttft, times = {}, [], {}
    t0 = time.perf_counter()
    for j, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"{tag}{j}", None, params, prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        done = engine.step()
        now = time.perf_counter()
        if not split:
            for rid, state in engine.requests.items():
                _note(times, rid, now, state.seqs[0].num_generated)
        for out in done:
            outputs[out.request_id] = list(out.outputs[0].token_ids) if out.outputs else None
            if out.error is None and out.metrics.ttft is not None:
                ttft.append(out.metrics.ttft)
            if not split and out.outputs:
                _note(times, out.request_id, now, len(out.outputs[0].token_ids))
    wall = time.perf_counter() - t0
    if split:
        times = engine.token_times
        engine.record_token_times = False
    gaps = []
    for seen in times.values():  # the first observation holds the first token (TTFT), not a gap
        for (t_a, c_a), (t_b, c_b) in zip(seen, seen[1:]):
            gaps += [(t_b - t_a) / (c_b - c_a)] * (c_b - c_a)
    tokens = sum(len(t) for t in outputs.values() if t)
    return dict(outputs=outputs, ttft=ttft, itl=gaps, wall_s=wall, output_tokens=tokens)


def _note(times: dict, rid: str, now: float, count: int) -> None:
    seen = times.setdefault(rid, [])
    if count and (not seen or seen[-1][1] != count):
        seen.append((now, count))


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-long-prompts", type=int, default=4, help="requests with a long prompt")
    parser.add_argument("--long-prompt-len", type=int, default=256)
    parser.add_argument("--short-output-tokens", type=int, default=4, help="output tokens of those")
    parser.add_argument("--num-long-outputs", type=int, default=4, help="requests with a long output")
    parser.add_argument("--short-prompt-len", type=int, default=16)
    parser.add_argument("--long-output-tokens", type=int, default=64, help="output tokens of those")
    parser.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    parser.add_argument("--bench-seed", dest="seed", type=int, default=0)
    parser.add_argument("--output-json", type=Path, default=RESULTS)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    for name in (
        "num_long_prompts", "long_prompt_len", "short_output_tokens", "num_long_outputs", "short_prompt_len",
        "long_output_tokens",
    ):  # fmt: skip
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    base = {k: v for k, v in vars(args).items() if k in fields}
    longest = max(
        args.long_prompt_len + args.short_output_tokens, args.short_prompt_len + args.long_output_tokens
    )
    base["max_model_len"] = base["max_model_len"] or longest + args.block_size
    base["disaggregation"] = "off"
    normal_args = EngineArgs(**base)
    split_args = EngineArgs(**(base | {"disaggregation": args.transport, "async_scheduling": False}))
    records, reference = [], None
    for config, make in (
        ("normal", lambda: LLMEngine(normal_args, num_speculative_tokens=0)),
        (f"disaggregated_{args.transport}", lambda: DisaggregatedEngine(split_args)),
    ):
        engine = make()
        try:
            requests = workload(args, engine.vocab_size)
            drive(engine, requests[:1], "warm")
            result = drive(engine, requests, "r")
        finally:
            engine.close()
        outputs = result["outputs"]
        if reference is None:
            reference = outputs
        ttft, itl = result["ttft"], result["itl"]
        records.append(
            dict(
                config=config,
                num_requests=len(requests),
                num_long_prompts=args.num_long_prompts,
                long_prompt_len_tokens=args.long_prompt_len,
                num_long_outputs=args.num_long_outputs,
                long_output_tokens=args.long_output_tokens,
                block_size_tokens=args.block_size,
                ttft_p50_ms=_pct(ttft, 50),
                ttft_p90_ms=_pct(ttft, 90),
                ttft_p99_ms=_pct(ttft, 99),
                itl_p50_ms=_pct(itl, 50),
                itl_p90_ms=_pct(itl, 90),
                itl_p99_ms=_pct(itl, 99),
                itl_max_ms=max(itl) * 1e3 if itl else None,
                wall_s=result["wall_s"],
                output_tok_per_s=result["output_tokens"] / result["wall_s"],
                outputs_equal_to_normal=outputs == reference,
            )
        )
    cols = [
        ("config", "{}"),
        ("ttft_p50_ms", "{:.1f}"),
        ("ttft_p90_ms", "{:.1f}"),
        ("ttft_p99_ms", "{:.1f}"),
        ("itl_p50_ms", "{:.1f}"),
        ("itl_p90_ms", "{:.1f}"),
        ("itl_p99_ms", "{:.1f}"),
        ("itl_max_ms", "{:.1f}"),
        ("wall_s", "{:.2f}"),
        ("output_tok_per_s", "{:.1f}"),
        ("outputs_equal_to_normal", "{}"),
    ]
    print_and_write(records, cols, args.output_json)
    return 0 if all(r["outputs_equal_to_normal"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
