"""Offline throughput benchmark (nano-vllm style): random prompts and output lengths, `ignore_eos`,
run once with the synchronous loop and once with the asynchronous one on the same workload.

On CUDA each record also has the device's idle gap before each decode step (CUDA events, see
engine/device_timing.py): `idle_gap_us_median` / `_p90` / `_mean` / `_max`, `device_busy_us_median`,
`device_idle_fraction` (gap / (gap + busy) over decode steps), `decode_steps_timed`; the async record's
`idle_gap_median_vs_sync` is its median gap over the sync loop's (how much host time it hides).
On the CPU these are None (nothing is timed there).

When the engine drafts (nextn > 0) the same workload also runs with drafts off (unless
--no-plain-baseline), interleaved with the drafted runs: records carry `drafts_on`, the drafted ones
acceptance per draft position, mean accepted length, and their tok/s, step time and device timings
against the plain run (`*_vs_plain`, `plain_*`; `bench/drafts.py`)."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from .drafts import compare_to_plain, spec_keys, spec_snapshot


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=16)
    g.add_argument("--min-input-len", type=int, default=16)
    g.add_argument("--max-input-len", type=int, default=64)
    g.add_argument("--min-output-len", type=int, default=8)
    g.add_argument("--max-output-len", type=int, default=32)
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--loops", default="sync,async", help="comma list of sync / async (default: both)")
    g.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed runs per loop, interleaved; the median is reported (default: 2)",
    )
    g.add_argument(
        "--no-plain-baseline",
        action="store_true",
        help="when the engine drafts (nextn > 0), do not also run the workload with drafts off "
        "(by default both run, interleaved, and the drafted records compare themselves to the plain ones)",
    )
    g.add_argument("--output-json", type=Path, default=None, help="write the result records here")


def make_workload(args, vocab_size: int):
    from ..sampling_params import SamplingParams

    for lo, hi in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if not 1 <= getattr(args, lo) <= getattr(args, hi):
            raise SystemExit(f"need 1 <= --{lo.replace('_', '-')} <= --{hi.replace('_', '-')}")
    rng = random.Random(args.workload_seed)
    prompts, params = [], []
    for i in range(args.num_requests):
        n_in = rng.randint(args.min_input_len, args.max_input_len)
        prompts.append([rng.randrange(3, vocab_size) for _ in range(n_in)])
        n_out = rng.randint(args.min_output_len, args.max_output_len)
        params.append(SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.8, seq_seed=i))
    return prompts, params


def run_bench(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..engine.llm_engine import LLMEngine
    from ..engine_args import EngineArgs
    from ..llm import LLM

    console = Console(width=160)
    loops = [m.strip() for m in args.loops.split(",") if m.strip()]
    for loop in loops:
        if loop not in ("sync", "async"):
            raise SystemExit(f"--loops entries must be sync or async, got {loop!r}")
    engines: dict[tuple[str, bool], LLM] = {}  # (loop, drafts on) -> engine
    for loop in loops:
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.async_scheduling = loop == "async"
        llm = LLM(**vars(engine_args))
        if llm.engine.use_async != (loop == "async"):
            raise SystemExit(
                "DEEPINFER_ZERO_OVERHEAD_SCHEDULING overrides --loops; unset it to compare loops"
            )
        drafts = int(getattr(llm.engine, "num_speculative_tokens", 0)) > 0
        engines[(loop, drafts)] = llm
        # (a data-parallel front builds its rank engines itself: no plain twin for it here)
        if drafts and not args.no_plain_baseline and engine_args.data_parallel_size <= 1:
            engines[(loop, False)] = LLM.from_engine(LLMEngine(engine_args, num_speculative_tokens=0))
    prompts, params = make_workload(args, next(iter(engines.values())).engine.vocab_size)
    for llm in engines.values():  # warm-up: one-time costs (allocations, first forward) are not timed
        llm.generate(prompt_token_ids=[prompts[0][:8]], sampling_params=params[0], use_tqdm=False)

    runs: dict[tuple[str, bool], list[dict]] = {key: [] for key in engines}
    tokens_by_run = {}
    for rep in range(args.repeats):
        keys = list(engines)
        order = keys if rep % 2 == 0 else keys[::-1]  # interleave so machine noise hits every run
        for key in order:
            loop = key[0]
            llm = engines[key]
            engine = llm.engine
            engine.flush_device_timing()  # the warm-up's / previous run's last steps go to the old stats
            engine.stats.__init__()
            spec_before = spec_snapshot(engine)
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=True)
            elapsed = time.perf_counter() - t0
            engine.flush_device_timing()  # after the clock: waiting for the events is not the run's time
            gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
            tokens_by_run[key] = [c.token_ids for o in outs for c in o.outputs]
            st = engine.stats
            runs[key].append(
                {
                    "loop": loop,
                    "model": str(engine.model_path),
                    "num_requests": len(prompts),
                    "prompt_tokens": sum(map(len, prompts)),
                    "output_tokens": gen,
                    "elapsed_s": elapsed,
                    "output_tok_per_s": gen / elapsed,
                    "total_tok_per_s": (gen + sum(map(len, prompts))) / elapsed,
                    "steps": st.steps,
                    "ms_per_step": elapsed * 1e3 / st.steps if st.steps else None,
                    "schedule_ms": st.schedule_s * 1e3,
                    "hidden_schedule_ms": st.hidden_schedule_s * 1e3,
                    "prepare_ms": st.prepare_s * 1e3,
                    "hidden_prepare_ms": st.hidden_prepare_s * 1e3,
                    "process_ms": st.process_s * 1e3,
                    "hidden_process_ms": st.hidden_process_s * 1e3,
                    "forward_ms": st.forward_s * 1e3,
                    "sample_ms": st.sample_s * 1e3,
                    **spec_keys(spec_before, spec_snapshot(engine)),
                    **_gap_keys(st),
                }
            )
    for llm in engines.values():
        llm.close()
    records = []
    for key in engines:
        ordered = sorted(runs[key], key=lambda r: r["output_tok_per_s"])
        median = dict(ordered[len(ordered) // 2])
        median["repeats"] = len(ordered)
        median["output_tok_per_s_min"] = ordered[0]["output_tok_per_s"]
        median["output_tok_per_s_max"] = ordered[-1]["output_tok_per_s"]
        records.append(median)
    for r in records:
        same_drafts = [b for b in records if b["drafts_on"] == r["drafts_on"]]
        base = next((b for b in same_drafts if b["loop"] == "sync"), None)
        r["speedup_vs_sync"] = r["output_tok_per_s"] / base["output_tok_per_s"] if base else None
        gap, base_gap = r["idle_gap_us_median"], base["idle_gap_us_median"] if base else None
        r["idle_gap_median_vs_sync"] = gap / base_gap if gap is not None and base_gap else None
        both = [(loop, r["drafts_on"]) for loop in ("sync", "async")]
        if all(k in tokens_by_run for k in both):
            r["tokens_identical_sync_async"] = tokens_by_run[both[0]] == tokens_by_run[both[1]]
        if r["drafts_on"]:
            plain = next((b for b in records if b["loop"] == r["loop"] and not b["drafts_on"]), None)
            if plain is not None:
                r.update(compare_to_plain(r, plain))

    table = Table(title="deepinfer offline throughput")
    for col in (
        "loop",
        "drafts",
        "requests",
        "out tokens",
        "tok/s",
        "vs sync",
        "steps",
        "schedule ms (hidden)",
        "prepare ms (hidden)",
        "out-proc ms (hidden)",
        "forward ms",
        "decode idle gap us med / p90",
        "gap vs sync",
    ):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            r["loop"],
            _drafts_cell(r),
            str(r["num_requests"]),
            str(r["output_tokens"]),
            f"{r['output_tok_per_s']:.1f}",
            "-" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.3f}x",
            str(r["steps"]),
            f"{r['schedule_ms']:.1f} ({r['hidden_schedule_ms']:.1f})",
            f"{r['prepare_ms']:.1f} ({r['hidden_prepare_ms']:.1f})",
            f"{r['process_ms']:.1f} ({r['hidden_process_ms']:.1f})",
            f"{r['forward_ms']:.0f}",
            "-"
            if r["idle_gap_us_median"] is None
            else f"{r['idle_gap_us_median']:.1f} / {r['idle_gap_us_p90']:.1f}",
            "-" if r["idle_gap_median_vs_sync"] is None else f"{r['idle_gap_median_vs_sync']:.3f}x",
        )
    console.print(table)
    for r in records:
        if "tokens_identical_sync_async" in r and r["loop"] == "async":
            on = "on" if r["drafts_on"] else "off"
            console.print(f"drafts {on}: sync and async tokens identical: {r['tokens_identical_sync_async']}")
        if r.get("output_tok_per_s_vs_plain") is not None:
            console.print(
                f"{r['loop']} loop, nextn {r['nextn']}: tok/s {r['output_tok_per_s_vs_plain']:.3f}x of drafts off, "
                f"step time {r['ms_per_step_vs_plain']:.3f}x, mean accepted {r['mean_accepted_len_tokens']:.3f} "
                f"drafts/step, acceptance per position "
                + " ".join(
                    "-" if r[f"accept_rate_pos{j}"] is None else f"{r[f'accept_rate_pos{j}']:.3f}"
                    for j in range(1, r["nextn"] + 1)
                )
            )
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(records, indent=2) + "\n")
        console.print(f"wrote {args.output_json}")
    return 0


def _drafts_cell(r: dict) -> str:
    if not r["drafts_on"]:
        return "off"
    acc = r.get("mean_accepted_len_tokens")
    return f"{r['nextn']} (acc {acc:.2f})" if acc is not None else str(r["nextn"])


def _gap_keys(stats) -> dict:
    """Device idle gap per decode step of one run (None on the CPU, where nothing is timed)."""
    from ..engine.device_timing import summarize_timings

    summary = summarize_timings(stats.device_timings, decode_only=True)
    return {
        "decode_steps_timed": summary["timed_steps"],
        **{k: summary[k] for k in summary if k != "timed_steps"},
    }
