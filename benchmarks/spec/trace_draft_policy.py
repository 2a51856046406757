"""Trace the draft policy of a drafting engine step by step: which steps ran ahead in the asynchronous loop,
which drafted, and the costs the policy priced them with.

    python benchmarks/spec/trace_draft_policy.py [--model PATH] [--num-seqs 64] [--max-tokens 96]

Random prompts of 64-127 tokens, greedy, nextn 5 (the reference default), the engine's defaults otherwise
(draft policy on, asynchronous loop: `SpecAsyncStep`). Prints one mark per step (`A`: a step is in flight
after it, i.e. plain steps run ahead; `s`: the loop waited; then `d`: the policy let someone draft after it,
`p`: so it did and probes were among them, `-`: no plan was made after it),
then the policy's counters, the last measured samples of each cost it keeps (ms over size), the step-time
curve and its predicted plain and verification steps. A diagnostic: it writes nothing.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a V4.1 checkpoint with draft blocks (default: built-in)")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--untimed",
        action="store_true",
        help="the policy without its wall clock (its parts' predictions alone)",
    )
    a = p.parse_args(argv)
    os.environ.setdefault("DEEPINFER_USE_NEXTN_DECODE", "5")
    from deepinfer import SamplingParams
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine_args import EngineArgs

    n = a.num_seqs
    engine = LLMEngine(EngineArgs(model=a.model, max_num_seqs=n))
    if engine.spec is None or engine.spec.policy is None:
        raise SystemExit(
            "this engine does not draft with the draft policy (no draft blocks, or MTP varlen off)"
        )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    for i in range(n):
        ids = rng.integers(10, 1000, int(rng.integers(64, 128))).tolist()
        engine.add_request(str(i), None, params, prompt_token_ids=ids)
    policy, marks = engine.spec.policy, []
    if a.untimed:
        policy.clock = None
    t0 = time.perf_counter()
    decisions = []  # (plan, drafting sequences, probes) of the plans that let someone draft
    while engine.has_unfinished_requests():
        drafted, probes, plans = policy.drafted, policy.probes, policy.plans
        engine.step()
        mark = "A" if engine.step_in_flight() else "s"
        if policy.drafted > drafted:
            mark += "d" if policy.probes == probes else "p"  # p: the drafting included probes
            decisions.append((policy.plans, policy.drafted - drafted, policy.probes - probes))
        elif policy.plans == plans:
            mark += "-"  # no plan (a prefill step, or plain steps ahead that the policy advanced past)
        marks.append(mark)
    wall = time.perf_counter() - t0
    print(
        f"{wall:.1f} s, {n * a.max_tokens / wall:.1f} tok/s, {engine.stats.steps} steps, "
        f"output processing {engine.stats.process_s:.2f} s"
    )
    print(" ".join(marks))
    stats = engine.spec_stats()
    print({k: v for k, v in stats.items() if k.startswith("policy") or k in ("async_steps", "accepted")})
    for name in ("verify_host", "plain_host", "cost", "plain_sampler", "verify_sampler"):
        print(f"{name:>15}", [(m, round(ms, 2)) for m, ms in list(getattr(policy, name).samples)[-6:]])
    print("curve ms", [(t, policy.rule.forward_ms(t)) for t in (1, 64, n, n + 5, n + 40, 6 * n)])
    print(
        "step ms: plain",
        policy.step_ms(n, n),
        "+5 drafts",
        policy.step_ms(n + 5, n),
        "+40",
        policy.step_ms(n + 40, n),
    )
    print(f"plans {policy.plans}, plain ms {policy.plain_ms:.1f}, probe ms {policy.probe_ms:.1f}")
    print(
        f"timed steps {policy.timed_plans}; wall / predicted: plain {policy.wall_ratio(False):.3f}, "
        f"drafted {policy.wall_ratio(True):.3f}; last samples plain",
        [round(x, 3) for x in list(policy.wall_ratios[False])[-6:]],
        "drafted",
        [round(x, 3) for x in list(policy.wall_ratios[True])[-6:]],
    )
    print("last drafting plans (plan, drafting sequences, of them probes):", decisions[-12:])
    # the plan's arithmetic for one sequence drafting its k best positions at the batch's rates: it drafts
    # where expected tokens per ms beat the plain step's (k = 0)
    rates = np.cumprod(policy.batch_rates())
    plain = policy.step_ms(n, n)
    for k in range(0, policy.nextn + 1):
        ms = policy.step_ms(n + k, n)
        if ms is None or plain is None:
            break
        ms = policy.charged_ms(ms + (policy.cost.get(1) if k else 0.0), k > 0)
        expected = n + float(rates[:k].sum())
        print(f"  k={k}: expected {expected:.3f} tokens in {ms:.3f} ms charged = {expected / ms:.4f} tok/ms")
    print("batch rates", np.round(policy.batch_rates(), 4).tolist())
    engine.close()


if __name__ == "__main__":
    main()
