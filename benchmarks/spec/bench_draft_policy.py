"""The draft policy against every draft verified and against drafts off, in one process.

    uv run --no-sync python benchmarks/spec/bench_draft_policy.py                    # deepinfer-tiny, nextn 5
    uv run --no-sync python benchmarks/spec/bench_draft_policy.py --temperatures 0.8 --repeats 3

Three engines of the same model decode the workload of `deepinfer bench throughput` (its --num-requests,
input and output lengths, seeded requests) with the synchronous loop:

* `policy`: nextn drafts with the draft policy (`DEEPINFER_ENABLE_MTP_VARLEN=1`, the default);
* `every_draft`: nextn drafts, every sequence verifying all of them (`DEEPINFER_ENABLE_MTP_VARLEN=0`);
* `off`: no drafts (nextn 0, what `DEEPINFER_USE_NEXTN_DECODE=0` gives).

`--drafter prefix --accepted A` replaces the model's drafter by one whose acceptance is controlled (greedy
only): it proposes the drafts-off engine's greedy continuation with every draft after the first A changed
to another id, so A drafts are accepted per drafted step (fewer near max_tokens), at no forward cost.

Per temperature (temperature 0 is greedy, whose tokens must be the same in all three) the runs interleave,
`--repeats` times each, and the median output tokens/s of each setting is compared with `off`. The policy's
counters (sequence-steps drafted, skipped, probing) and the acceptance over the runs are reported too. On
a shared CPU the times are noisy: only the ratios of one invocation mean something.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from deepinfer import SamplingParams
from deepinfer.bench.drafts import spec_keys, spec_snapshot
from deepinfer.bench.engine_driver import environment
from deepinfer.bench.throughput import make_workload
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.llm import LLM
from prefix_drafter import PrefixDrafter, record_full

SETTINGS = ("policy", "every_draft", "off")


def build(setting: str, model: str | None, nextn: int) -> LLM:
    """The setting's engine (the policy is chosen when the engine is built)."""
    args = EngineArgs(model=model, async_scheduling=False, disable_log_stats=True)
    varlen = "1" if setting == "policy" else "0"
    with environment("DEEPINFER_ENABLE_MTP_VARLEN", varlen):
        engine = LLMEngine(args, num_speculative_tokens=0 if setting == "off" else nextn)
    return LLM.from_engine(engine)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in deepinfer-tiny")
    ap.add_argument("--nextn", type=int, default=5)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--min-input-len", type=int, default=16)
    ap.add_argument("--max-input-len", type=int, default=64)
    ap.add_argument("--min-output-len", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=64)
    ap.add_argument("--workload-seed", type=int, default=0)
    ap.add_argument("--temperatures", default="0.8,0", help="comma list (0: greedy)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--drafter", choices=("model", "prefix"), default="model")
    ap.add_argument("--accepted", type=int, default=1, help="--drafter prefix: drafts accepted per step")
    ap.add_argument("--output-json", type=Path, default=None)
    args = ap.parse_args(argv)
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    if args.drafter == "prefix" and temperatures != [0.0]:
        raise SystemExit(f"--drafter prefix needs --temperatures 0 (greedy), got {args.temperatures}")

    engines = {s: build(s, args.model, args.nextn) for s in SETTINGS}
    if engines["policy"].engine.spec is None or engines["policy"].engine.spec.policy is None:
        raise SystemExit("the model does not draft (no DSpark draft blocks)")
    prompts, sampled = make_workload(args, engines["off"].engine.vocab_size)
    for llm in engines.values():  # warm-up: one-time costs are not timed
        llm.generate(prompt_token_ids=[prompts[0][:8]], sampling_params=sampled[0], use_tqdm=False)
    if args.drafter == "prefix":  # the drafts-off greedy continuation, recorded once (untimed)
        greedy = [
            SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=0, seq_seed=p.seq_seed)
            for p in sampled
        ]
        full = record_full(engines["off"], prompts, greedy)
        for setting in ("policy", "every_draft"):
            drafter = PrefixDrafter(full, args.accepted, engines["off"].engine.vocab_size)
            engines[setting].engine.spec.drafter = drafter

    records = []
    for temperature in temperatures:
        params = [
            SamplingParams(
                max_tokens=p.max_tokens, ignore_eos=True, temperature=temperature, seq_seed=p.seq_seed
            )
            for p in sampled
        ]
        runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        tokens: dict[str, list] = {}
        for rep in range(args.repeats):
            for setting in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:  # noise hits every setting
                llm = engines[setting]
                spec = llm.engine.spec
                before = spec_snapshot(llm.engine)
                policy_before = dict(spec.policy.summary()) if spec is not None and spec.policy else {}
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                tokens[setting] = [list(c.token_ids) for o in outs for c in o.outputs]
                generated = sum(len(t) for t in tokens[setting])
                run = {"output_tok_per_s": generated / elapsed, "elapsed_s": elapsed}
                run.update(spec_keys(before, spec_snapshot(llm.engine)))
                if policy_before:
                    after = spec.policy.summary()
                    for key in (
                        "policy_drafted_seq_steps",
                        "policy_skipped_seq_steps",
                        "policy_probe_seq_steps",
                    ):
                        run[key] = after[key] - policy_before[key]
                runs[setting].append(run)
        off = statistics.median(r["output_tok_per_s"] for r in runs["off"])
        for setting in SETTINGS:
            ordered = sorted(runs[setting], key=lambda r: r["output_tok_per_s"])
            rec = dict(ordered[len(ordered) // 2])
            rec.update(
                setting=setting,
                temperature=temperature,
                nextn=0 if setting == "off" else args.nextn,
                repeats=len(ordered),
                output_tok_per_s=statistics.median(r["output_tok_per_s"] for r in ordered),
                output_tok_per_s_min=ordered[0]["output_tok_per_s"],
                output_tok_per_s_max=ordered[-1]["output_tok_per_s"],
            )
            rec["output_tok_per_s_vs_off"] = rec["output_tok_per_s"] / off
            if temperature == 0:
                rec["greedy_tokens_equal_off"] = tokens[setting] == tokens["off"]
            records.append(rec)
    for llm in engines.values():
        llm.close()

    for r in records:
        drafted = r.get("policy_drafted_seq_steps")
        offered = drafted + r["policy_skipped_seq_steps"] if drafted is not None else None
        print(
            f"T={r['temperature']:<4} {r['setting']:<12} {r['output_tok_per_s']:8.2f} tok/s "
            f"({r['output_tok_per_s_min']:.2f}-{r['output_tok_per_s_max']:.2f})  "
            f"{r['output_tok_per_s_vs_off']:.3f}x of off"
            + (
                f"  verified/req-step {r['mean_verified_len_tokens']:.2f}"
                if r.get("mean_verified_len_tokens") is not None
                else ""
            )
            + (
                f"  accepted/req-step {r['mean_accepted_len_tokens']:.3f}"
                if r.get("mean_accepted_len_tokens") is not None
                else ""
            )
            + (f"  drafted {drafted}/{offered} seq-steps" if offered else "")
            + (
                f"  greedy tokens = off: {r['greedy_tokens_equal_off']}"
                if "greedy_tokens_equal_off" in r
                else ""
            )
        )
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
