"""Speculative decoding mechanics on a toy target: acceptance, tokens per step, verification overhead.

    uv run --no-sync python benchmarks/spec/bench_spec.py            # defaults: 32 requests x 64 tokens
    uv run --no-sync python benchmarks/spec/bench_spec.py --curve my_curve.json

NOT A REAL MODEL. The target is a fixed random bigram table (deepinfer_spec.toy.NGramModel); drafters:
  none     no drafts (nextn = 0): the baseline every ratio is measured against, in the same run;
  oracle   proposes the target's own next tokens: every draft is accepted, the mechanism's ceiling;
  mixture  q = 0.7 * target + 0.3 * random table, with a calibrated confidence (the exact acceptance
           probability of the verifier's scheme: coupled agreement, or Σ min(p, q) for rejection);
  random   an unrelated random table: shows what a random-weight drafter gets (no real acceptance).
Acceptance numbers therefore say nothing about the real DSpark drafter.

Time columns:
  spec_us_per_step   wall time of this package's calls per step (varlen rule, packing, verification,
                     bookkeeping, stats); overhead_vs_no_draft is its ratio to the no-draft run.
  modelled_*         step time from a step-time curve (tokens -> ms): an ASSUMED memory-bound decode
                     curve unless --curve gives a measured one. Tokens per modelled second and the
                     speedup over no drafts use it; full_acceptance_tok_per_s is the reference's headline
                     accounting (steps/s x batch x (1 + nextn) / cp) under the same curve.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from deepinfer_spec import ConfidenceScheduler, StepTimeCurve, full_acceptance_tokens_per_s
from deepinfer_spec.toy import Drafter, NGramModel, run_toy_decode
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_spec.json"
DRAFTERS = {"oracle": 1.0, "mixture": 0.7, "random": 0.0}


def assumed_curve(batch: int, nextn: int) -> StepTimeCurve:
    """Decode is weight-bandwidth bound: flat up to a knee, then linear (invented numbers)."""
    sizes = list(range(batch, batch * (1 + nextn) + 1, max(1, batch // 4)))
    if sizes[-1] != batch * (1 + nextn):
        sizes.append(batch * (1 + nextn))
    knee = 2 * batch
    return StepTimeCurve(sizes, [20.0 + 0.15 * max(0, s - knee) for s in sizes])


def run_config(args, target, curve, drafter_name, temperature, varlen):
    nextn = 0 if drafter_name == "none" else args.nextn
    drafter = None if drafter_name == "none" else Drafter(target, DRAFTERS[drafter_name], seed=args.seed + 1)
    scheduler = ConfidenceScheduler(nextn, curve if varlen else None)
    prompts = [[(7 * i) % args.vocab, (3 * i + 1) % args.vocab] for i in range(args.batch)]
    run = run_toy_decode(
        target, drafter, prompts, args.max_new_tokens, nextn, temperature, range(args.batch), scheduler
    )
    stats = run.stats
    modelled_ms = sum(curve.baseline_ms(plan.num_tokens) for plan in run.plans)
    emitted = sum(len(o) for o in run.outputs)
    steps_per_s = stats.steps / (modelled_ms / 1e3)
    record = {
        "drafter": drafter_name,
        "temperature": temperature,
        "varlen": varlen,
        "nextn": nextn,
        "batch": args.batch,
        "steps": stats.steps,
        "tokens_per_request_step": stats.tokens_per_request_step(),
        "avg_accept_rate": stats.avg_accept_rate(),
        "avg_accepted_len": stats.avg_accepted_len(),
        "avg_verified_len": stats.avg_verified_len(),
        "confidence_ece": stats.calibration_error(),
        "spec_us_per_step": run.spec_seconds / stats.steps * 1e6,
        "modelled_ms_per_step": modelled_ms / stats.steps,
        "modelled_tok_per_s": emitted / (modelled_ms / 1e3),
        "full_acceptance_tok_per_s": full_acceptance_tokens_per_s(
            steps_per_s, stats.request_steps / stats.steps, nextn
        ),
    }
    for j, rate in enumerate(stats.acceptance_rate_per_position()):
        record[f"accept_rate_pos{j + 1}"] = rate
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32, help="requests decoded together")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--nextn", type=int, default=5, help="drafts proposed per step (DEEPINFER_USE_NEXTN_DECODE)"
    )
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--curve", type=Path, help="step-time curve JSON ({'sizes': [...], 'forward_ms': [...]})"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: small ops, shared CPU)"
    )
    parser.add_argument("--output-json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.nextn < 1 or args.batch < 1 or args.max_new_tokens < 1 or args.vocab < 2:
        parser.error("nextn, batch and max-new-tokens must be >= 1 and vocab >= 2")

    torch.set_num_threads(args.threads)
    target = NGramModel(args.vocab, order=2, seed=args.seed, scale=3.0)
    curve = StepTimeCurve.load(args.curve) if args.curve else assumed_curve(args.batch, args.nextn)
    configs = [("none", t, False) for t in (0.0, 1.0)]
    configs += [(d, t, v) for d in DRAFTERS for t in (0.0, 1.0) for v in (False, True)]
    records = []
    for name, temperature, varlen in tqdm(configs, desc="configs"):
        records.append(run_config(args, target, curve, name, temperature, varlen))

    baseline = {r["temperature"]: r for r in records if r["drafter"] == "none"}
    for r in records:
        base = baseline[r["temperature"]]
        r["overhead_vs_no_draft"] = r["spec_us_per_step"] / base["spec_us_per_step"]
        r["modelled_speedup_vs_no_draft"] = r["modelled_tok_per_s"] / base["modelled_tok_per_s"]

    console = Console(width=max(Console().width, 190))
    console.print(
        "[bold]Toy target (random bigram table), NOT a real model.[/bold] A random-weight drafter cannot "
        "show real acceptance; the oracle shows the ceiling. Curve: "
        + (f"measured, from {args.curve}" if args.curve else "ASSUMED (flat to 2x batch, then linear)")
    )
    table = Table()
    cols = [
        ("drafter", "drafter"),
        ("temp", "temperature"),
        ("varlen", "varlen"),
        ("tok/req-step", "tokens_per_request_step"),
        ("accept", "avg_accept_rate"),
        ("verified len", "avg_verified_len"),
        ("ECE", "confidence_ece"),
        ("spec us/step", "spec_us_per_step"),
        ("overhead x", "overhead_vs_no_draft"),
        ("model ms/step", "modelled_ms_per_step"),
        ("model tok/s", "modelled_tok_per_s"),
        ("speedup x", "modelled_speedup_vs_no_draft"),
        ("full-accept tok/s", "full_acceptance_tok_per_s"),
    ]
    for title, _ in cols:
        table.add_column(title, justify="right")
    for r in records:
        table.add_row(*[f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for _, k in cols])
    console.print(table)
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(records, indent=1))
    console.print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
