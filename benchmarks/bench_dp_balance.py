"""Routing over data-parallel ranks: static vs round_robin vs balanced on one skewed workload, same run.

The workload: many short prompts, a few very long ones, and groups of prompts that share a long prefix,
shuffled and submitted in waves (`--waves`, `--wave-gap-s` apart) to a data-parallel engine, once per
policy (`dp_routing`), each on fresh rank processes. Per policy, from the ranks' own step traces: each
rank's busy time (the steps it ran with work), their spread (max / mean), the total wall time, the
perfectly balanced lower bound (the busy time shared evenly over the ranks; with waves also, for each
wave, its arrival plus the work done after it shared evenly: the waiting for arrivals is nobody's
imbalance) and total / bound; the prefix-cache hit rate the ranks measured; what the router did
(moves, prefix-affine routings); and whether every output equals the first policy's (they must: routing
never changes a request's tokens).

    uv run --no-sync python benchmarks/bench_dp_balance.py --dp 2 --num-short 32 --num-long 3

Without --model it builds a small random checkpoint (the engine tests' two-layer public V4) in a
temporary directory. Prints a table and writes one flat JSON record per policy to --out (default
benchmarks/out/bench_dp_balance.json); a path git tracks is refused, so committed results are never
overwritten. On a small shared CPU host the times are noisy: compare policies within one run.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "out" / "bench_dp_balance.json"
POLICIES = ("static", "round_robin", "balanced")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: a small random one)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (1: plain replicas)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of dp_routing policies")
    p.add_argument("--num-short", type=int, default=32, help="short prompts")
    p.add_argument("--short-len", default="8,48", help="short prompt length range lo,hi")
    p.add_argument("--num-long", type=int, default=3, help="very long prompts")
    p.add_argument("--long-len", type=int, default=768, help="length of a long prompt")
    p.add_argument("--groups", type=int, default=3, help="shared-prefix groups")
    p.add_argument("--group-size", type=int, default=6, help="prompts per group")
    p.add_argument("--prefix-len", type=int, default=192, help="shared prefix length of a group")
    p.add_argument("--suffix-len", type=int, default=8, help="own tokens after a group's prefix")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (ignore_eos)")
    p.add_argument("--waves", type=int, default=4, help="the shuffled requests arrive in this many waves")
    p.add_argument("--wave-gap-s", type=float, default=0.5, help="seconds between waves")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON records (default: %(default)s)")
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in args.policies if x not in POLICIES]
    if bad or not args.policies:
        p.error(f"--policies must be a comma list of {', '.join(POLICIES)}, got {bad or args.policies}")
    lo, _, hi = args.short_len.partition(",")
    args.short_len = (int(lo), int(hi or lo))
    if not 1 <= args.short_len[0] <= args.short_len[1]:
        p.error(f"--short-len must be lo,hi with 1 <= lo <= hi, got {args.short_len}")
    for name in ("dp", "ep", "waves", "block_size", "max_num_seqs", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def workload(args, vocab: int) -> list[list[int]]:
    """Shuffled: short prompts, long prompts, and groups sharing a prefix."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prompts = [tokens(rng.randint(*args.short_len)) for _ in range(args.num_short)]
    prompts += [tokens(args.long_len) for _ in range(args.num_long)]
    for _ in range(args.groups):
        prefix = tokens(args.prefix_len)
        prompts += [prefix + tokens(args.suffix_len) for _ in range(args.group_size)]
    rng.shuffle(prompts)
    return prompts


def refuse_tracked(path: Path) -> None:
    """Committed results are never overwritten: a path git tracks is an error."""
    try:
        tracked = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--error-unmatch", str(path.resolve())],
            capture_output=True,
        ).returncode == 0  # fmt: skip
    except OSError:
        tracked = False
    if tracked:
        sys.exit(f"--out {path} is a committed file; choose another path")


def busy_steps(trace: dict) -> list[dict]:
    """A rank's steps that had work (a step with nothing running, waiting, emitted or finished is the
    rank's loop noticing it is done)."""
    return [s for s in trace["steps"] if s["running"] or s["waiting"] or s["emitted_tokens"] or s["finished"]]


def balanced_bound(traces: list[dict], arrivals: list[float], t0: float, ranks: int) -> float:
    """Seconds from t0 that perfectly balanced ranks would need at least for the work these ranks did:
    all of it shared evenly, and, for each wave arriving at `arrivals[w]` (perf_counter times, as the
    ranks' step ends), the work the ranks did from then on shared evenly after it (a step that began
    before the arrival counts for its part after it)."""
    steps = [s for t in traces for s in busy_steps(t)]
    bound = sum(s["seconds"] for s in steps) / ranks
    for arrival in arrivals:
        after = sum(min(s["seconds"], max(0.0, s["end"] - arrival)) for s in steps)
        bound = max(bound, arrival - t0 + after / ranks)
    return bound


def run_policy(args, model: str, policy: str, prompts: list[list[int]]) -> tuple[dict, dict]:
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(
        model, data_parallel_size=args.dp, expert_parallel_size=args.ep, dp_routing=policy,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, num_threads=1, seed=args.seed,
    ) as llm:  # fmt: skip
        engine = llm.engine
        # warm up every rank (first forwards allocate), with prompts that share nothing with the workload
        llm.generate(prompt_token_ids=[[1, 2, 3]] * (2 * args.dp), sampling_params=params, use_tqdm=False)
        before = engine.scheduler_stats()
        engine.start_step_trace()
        waves = [prompts[i :: args.waves] for i in range(args.waves)]
        outputs: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        next_wave, n, arrivals = 0, 0, []
        while next_wave < len(waves) or engine.has_unfinished_requests():
            if next_wave < len(waves) and time.perf_counter() - t0 >= next_wave * args.wave_gap_s:
                arrivals.append(time.perf_counter())
                for prompt in waves[next_wave]:
                    engine.add_request(f"w{next_wave}-{n}", None, params, prompt_token_ids=prompt)
                    n += 1
                next_wave += 1
            for o in engine.step():
                outputs[o.request_id] = list(o.outputs[0].token_ids)
            if not engine.has_unfinished_requests() and next_wave < len(waves):
                time.sleep(max(0.0, next_wave * args.wave_gap_s - (time.perf_counter() - t0)))
        total = time.perf_counter() - t0
        traces = engine.step_traces()
        after = engine.scheduler_stats()
        routing = engine.routing_stats()
    busy = [sum(s["seconds"] for s in busy_steps(t)) for t in traces]
    mean = sum(busy) / len(busy)
    bound = balanced_bound(traces, arrivals, t0, args.dp)
    query = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
    hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    record = {
        "policy": policy,
        "dp": args.dp,
        "ep": args.ep,
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "total_s": total,
        "busy_s_per_rank": busy,
        "busy_spread_max_over_mean": max(busy) / mean if mean else 0.0,
        "balanced_bound_s": bound,
        "total_over_bound": total / bound if bound else 0.0,
        "prefix_hit_rate": hit / query if query else 0.0,
        "routed_requests_per_rank": routing["routed_requests"],
        "routed_tokens_per_rank": routing["routed_tokens"],
        "prefix_routed": routing["prefix_routed"],
        "moves": routing["moves"],
        "moved_requests": routing["moved_requests"],
    }
    return record, outputs


def print_table(records: list[dict]) -> None:
    header = [
        "policy",
        "total s",
        "busy s per rank",
        "spread",
        "bound s",
        "total/bound",
        "prefix hit",
        "moved",
    ]
    rows = [
        [
            r["policy"],
            f"{r['total_s']:.2f}",
            " / ".join(f"{b:.2f}" for b in r["busy_s_per_rank"]),
            f"{r['busy_spread_max_over_mean']:.3f}",
            f"{r['balanced_bound_s']:.2f}",
            f"{r['total_over_bound']:.3f}",
            f"{r['prefix_hit_rate']:.1%}",
            str(r["moved_requests"]),
        ]
        for r in records
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="data-parallel routing")
        for h in header:
            table.add_column(h)
        for row in rows:
            table.add_row(*row)
        Console(width=160).print(table)
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        for row in [header, *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refuse_tracked(args.out)
    with tempfile.TemporaryDirectory(prefix="bench-dp-balance-") as tmp:
        model = args.model
        vocab = 512
        if model is None:
            from deepinfer_model.testing import make_checkpoint
            from deepinfer_model.testing.checkpoint import tiny_config

            config = tiny_config(
                vocab_size=vocab, num_hidden_layers=2, n_routed_experts=4, max_position_embeddings=2048,
                layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe"],
            )  # fmt: skip
            model = str(make_checkpoint(Path(tmp) / "model", config, seed=1))
        else:
            vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        prompts = workload(args, vocab)
        records, first = [], None
        for policy in args.policies:
            record, outputs = run_policy(args, model, policy, prompts)
            first = outputs if first is None else first
            record["outputs_equal_first_policy"] = outputs == first
            records.append(record)
    print_table(records)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["outputs_equal_first_policy"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
