"""Host cost of a drafted step against a plain step, in one process: nextn drafts and drafts off.

    uv run --no-sync python benchmarks/spec/bench_draft_host.py --model CKPT              # nextn 5
    uv run --no-sync python benchmarks/spec/bench_draft_host.py --model CKPT --label after --repeats 3

Two engines of the same model (the paged runner and its default drafter, the loop of --loop) decode the
workload of `deepinfer bench throughput` (its --num-requests, input and output lengths, seeded requests
at --temperature; 0 is greedy): one with --nextn drafts, one with drafts off. Their runs interleave,
--repeats times each, and the median run of each is reported. By default every decoding sequence
verifies every draft (`DEEPINFER_ENABLE_MTP_VARLEN=0`), so every decode step is a drafted step and the
host cost per drafted step is what the drafted engine's counters divide; --varlen keeps the draft policy.
`--drafter prefix --accepted A` replaces the model's drafter by one of controlled acceptance
(`prefix_drafter.py`: A drafts right per step, no forward; greedy), e.g. A = 0 with --varlen: the policy backs
off and the drafted engine's steps are the plain steps of a drafting engine.

Per engine: output tokens/s, steps, and the engine's host counters per step: `prepare` (building the step's
batch and verify inputs), `sample` (after the forward: the plain sampler, or the verification of the
drafts), `out-proc` (`process`: committing, stop handling, and the drafter's proposal after the step), of
which `draft` is the proposal. `host ms per plain / verification step` splits the drafted engine's steps
by whether they verified drafts: each step's prepare + out-proc less the drafter's own time (the draft
forward), the median over steps of each kind (the host work the draft policy charges, whatever the
drafter costs). On the CPU each of these includes the tensor work it launches (a GPU
would run it asynchronously); the forward is not included. The table prints the drafted / plain ratios;
the records (flat JSON, units in the key names) are appended to --out under --label, e.g. "before" and
"after" a change run from two checkouts, so earlier records stay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from deepinfer import SamplingParams
from deepinfer.bench.drafts import spec_keys, spec_snapshot
from deepinfer.bench.engine_driver import environment
from deepinfer.bench.throughput import make_workload
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine_args import EngineArgs
from deepinfer.llm import LLM
from prefix_drafter import PrefixDrafter, record_full

RESULTS = Path(__file__).resolve().parents[1] / "results" / "bench_draft_host.json"
COUNTERS = ("prepare", "sample", "process", "draft", "forward")


def build(model: str | None, nextn: int, max_num_seqs: int, loop: str, varlen: bool) -> LLM:
    args = EngineArgs(
        model=model, max_num_seqs=max_num_seqs, async_scheduling=loop == "async", disable_log_stats=True
    )
    with environment("DEEPINFER_ENABLE_MTP_VARLEN", "1" if varlen else "0"):
        engine = LLMEngine(args, num_speculative_tokens=nextn)
    return LLM.from_engine(engine)


class StepHostTimes:
    """Wraps `engine.step`: per step, host milliseconds outside the forward, the sampler and the draft
    forward (prepare + process less the drafter's time), by whether the step verified drafts."""

    def __init__(self, engine) -> None:
        self.engine, self.inner = engine, engine.step
        self.plain_ms: list[float] = []
        self.verify_ms: list[float] = []

    def __call__(self):
        engine, st = self.engine, self.engine.stats
        counts = engine.spec_counts()
        verified0 = sum(counts["verified"]) if counts else 0
        draft0 = counts["draft_s"] if counts else 0.0
        host0 = st.prepare_s + st.process_s
        outs = self.inner()
        counts = engine.spec_counts()
        verified = (sum(counts["verified"]) if counts else 0) > verified0
        draft_s = (counts["draft_s"] if counts else 0.0) - draft0
        (self.verify_ms if verified else self.plain_ms).append(
            1e3 * (st.prepare_s + st.process_s - host0 - draft_s)
        )
        return outs


def timed_run(llm: LLM, prompts, params) -> dict:
    engine = llm.engine
    engine.stats.__init__()
    before = spec_snapshot(engine)
    steps = engine.step = StepHostTimes(engine)
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del engine.step
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    st = engine.stats
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    rec = {"output_tok_per_s": generated / elapsed, "elapsed_s": elapsed, "steps": st.steps}
    # the process's CPU time (all threads): on a shared host less sensitive to the other jobs than wall time
    rec["cpu_s"] = cpu_s
    rec["cpu_ms_per_output_token"] = 1e3 * cpu_s / generated if generated else None
    for name in COUNTERS:
        total_ms = 1e3 * getattr(st, f"{name}_s")
        rec[f"{name}_ms"] = total_ms
        rec[f"{name}_ms_per_step"] = total_ms / st.steps if st.steps else None
    rec.update(spec_keys(before, spec_snapshot(engine)))
    for kind, ms in (("plain", steps.plain_ms), ("verify", steps.verify_ms)):
        rec[f"{kind}_steps"] = len(ms)
        rec[f"host_ms_per_{kind}_step_median"] = statistics.median(ms) if ms else None
    rec["tokens"] = [list(c.token_ids) for o in outs for c in o.outputs]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in deepinfer-tiny")
    ap.add_argument("--nextn", type=int, default=5)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--min-input-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--min-output-len", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=32)
    ap.add_argument("--workload-seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--loop", choices=("sync", "async"), default="async")
    ap.add_argument("--varlen", action="store_true", help="keep the draft policy (MTP varlen) on")
    ap.add_argument("--drafter", choices=("model", "prefix"), default="model")
    ap.add_argument("--accepted", type=int, default=0, help="--drafter prefix: drafts accepted per step")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--label", default="", help="tag of the records, e.g. before / after a change")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON list the records are appended to")
    args = ap.parse_args(argv)
    if args.nextn < 1:
        raise SystemExit(f"--nextn must be >= 1 (the drafted engine), got {args.nextn}")
    if args.drafter == "prefix" and args.temperature != 0:
        raise SystemExit(f"--drafter prefix needs --temperature 0 (greedy), got {args.temperature}")

    engines = {
        "drafted": build(args.model, args.nextn, args.max_num_seqs, args.loop, args.varlen),
        "plain": build(args.model, 0, args.max_num_seqs, args.loop, args.varlen),
    }
    if engines["drafted"].engine.spec is None:
        raise SystemExit("the model does not draft (no DSpark draft blocks)")
    ns = SimpleNamespace(**vars(args))
    prompts, base = make_workload(ns, engines["plain"].engine.vocab_size)
    params = [
        SamplingParams(
            max_tokens=p.max_tokens, ignore_eos=True, temperature=args.temperature, seq_seed=p.seq_seed
        )
        for p in base
    ]
    for llm in engines.values():  # warm-up: one-time costs are not timed
        llm.generate(prompt_token_ids=[prompts[0][:8]], sampling_params=params[0], use_tqdm=False)
    if args.drafter == "prefix":  # the drafts-off continuation, recorded once (untimed)
        full = record_full(engines["plain"], prompts, params)
        engines["drafted"].engine.spec.drafter = PrefixDrafter(
            full, args.accepted, engines["plain"].engine.vocab_size
        )

    runs: dict[str, list[dict]] = {s: [] for s in engines}
    for rep in range(args.repeats):
        for setting in engines if rep % 2 == 0 else list(engines)[::-1]:  # noise hits both
            runs[setting].append(timed_run(engines[setting], prompts, params))
    for llm in engines.values():
        llm.close()

    records = {}
    for setting, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r["output_tok_per_s"])
        rec = dict(ordered[len(ordered) // 2])
        tokens = rec.pop("tokens")
        rec.update(
            label=args.label,
            setting=setting,
            model=args.model or "deepinfer-tiny",
            loop=args.loop,
            varlen=args.varlen,
            drafter=args.drafter if args.drafter == "model" else f"prefix, {args.accepted} accepted",
            temperature=args.temperature,
            num_requests=args.num_requests,
            max_num_seqs=args.max_num_seqs,
            repeats=len(ordered),
            output_tok_per_s_min=ordered[0]["output_tok_per_s"],
            output_tok_per_s_max=ordered[-1]["output_tok_per_s"],
        )
        records[setting] = (rec, tokens)
    drafted, plain = records["drafted"][0], records["plain"][0]
    drafted["output_tok_per_s_vs_plain"] = drafted["output_tok_per_s"] / plain["output_tok_per_s"]
    drafted["cpu_per_token_vs_plain"] = drafted["cpu_ms_per_output_token"] / plain["cpu_ms_per_output_token"]
    for name in COUNTERS:
        mine, theirs = drafted[f"{name}_ms_per_step"], plain[f"{name}_ms_per_step"]
        drafted[f"{name}_per_step_vs_plain"] = mine / theirs if mine is not None and theirs else None
    # seeded sampled and greedy tokens alike are the drafts-off ones (coupled verification)
    drafted["tokens_equal_plain"] = records["drafted"][1] == records["plain"][1]

    print(
        f"{'engine':<8} {'tok/s':>8} {'steps':>6} "
        + " ".join(f"{n + ' ms/step':>17}" for n in COUNTERS)
        + "  accepted/req-step"
    )
    for setting, (rec, _) in records.items():
        acc = rec.get("mean_accepted_len_tokens")
        print(
            f"{setting:<8} {rec['output_tok_per_s']:8.1f} {rec['steps']:6d} "
            + " ".join(f"{rec[f'{n}_ms_per_step'] or 0.0:17.2f}" for n in COUNTERS)
            + (f"  {acc:.3f}" if acc is not None else "  -")
        )
    print(
        "drafted / plain: tok/s {:.3f}x, CPU time per token {:.2f}x; ".format(
            drafted["output_tok_per_s_vs_plain"], drafted["cpu_per_token_vs_plain"]
        )
        + ", ".join(
            f"{n} {drafted[f'{n}_per_step_vs_plain']:.1f}x"
            for n in COUNTERS
            if drafted[f"{n}_per_step_vs_plain"] is not None
        )
        + f"; tokens equal: {drafted['tokens_equal_plain']}"
    )
    for setting, (rec, _) in records.items():
        print(
            f"{setting}: host ms per step (median) "
            + ", ".join(
                f"{kind} {rec[f'host_ms_per_{kind}_step_median']:.2f} ({rec[f'{kind}_steps']} steps)"
                for kind in ("plain", "verify")
                if rec[f"{kind}_steps"]
            )
        )
    out = json.loads(args.out.read_text()) if args.out.exists() else []
    out.extend([drafted, plain])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"appended 2 records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
