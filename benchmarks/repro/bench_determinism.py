"""The determinism study at full size: `--num-requests` (1,000) identical requests mixed into batches
of varying size and composition must give exactly one distinct completion.

Runs at temperature 0 and at `--temperature` > 0 with one fixed seq_seed, under
DEEPINFER_BATCH_INVARIANT=1 and DEEPINFER_ENABLE_MTP_VARLEN=0, on the default deepinfer-tiny model
with the paged runner, in the async loop. Each round submits a random number of copies (up to
`--max-copies`) shuffled together with random filler requests (other prompts, lengths, seeds), until
`--num-requests` copies have run. As a control, the same number of copies with distinct seq_seeds at
`--temperature` must give more than one completion. Prints a table and writes
benchmarks/out/bench_determinism.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

RESULTS = Path(__file__).resolve().parents[1] / "out" / "bench_determinism.json"


def _llm(args):
    from deepinfer import LLM
    from deepinfer_model.runtime import make_runner

    llm = LLM(num_threads=args.threads, max_num_batched_tokens=args.token_budget, max_num_seqs=64)
    e = llm.engine
    e.runner = e.worker.runner = make_runner("paged", e.model, e.runner.num_blocks, e.runner.block_size)
    return llm


def _study(llm, args, temperature: float, distinct_seeds: bool) -> dict:
    from deepinfer import SamplingParams

    rng = np.random.default_rng(args.seed)
    prompt = np.random.default_rng(3).integers(1000, 90_000, args.prompt_len).tolist()
    completions, rounds, done = [], 0, 0
    bar = tqdm(
        total=args.num_requests, desc=f"T={temperature} seeds={'distinct' if distinct_seeds else 'one'}"
    )
    t0 = time.perf_counter()
    while done < args.num_requests:
        copies = min(int(rng.integers(1, args.max_copies + 1)), args.num_requests - done)
        items = [
            (
                prompt,
                SamplingParams(
                    temperature=temperature,
                    max_tokens=args.max_tokens,
                    ignore_eos=True,
                    seq_seed=(done + i) if distinct_seeds else 1234,
                ),
                True,
            )
            for i in range(copies)
        ]
        for _ in range(int(rng.integers(0, args.max_fillers + 1))):
            filler = rng.integers(1000, 90_000, int(rng.integers(2, 60))).tolist()
            p = SamplingParams(temperature=1.0, max_tokens=int(rng.integers(1, 10)), ignore_eos=True)
            items.append((filler, p, False))
        order = rng.permutation(len(items))
        outs = llm.generate(
            prompt_token_ids=[items[i][0] for i in order],
            sampling_params=[items[i][1] for i in order],
            use_tqdm=False,
        )
        for k, i in enumerate(order):
            if not items[i][2]:
                continue
            out = outs[k]
            if out.error is not None or len(out.outputs[0].token_ids) != args.max_tokens:
                raise RuntimeError(
                    f"request {out.request_id} did not complete: {out.error or out.outputs[0]}"
                )
            completions.append(tuple(out.outputs[0].token_ids))
        done += copies
        rounds += 1
        bar.update(copies)
    bar.close()
    return {
        "temperature": temperature,
        "seq_seeds": "distinct" if distinct_seeds else "one",
        "requests": len(completions),
        "rounds": rounds,
        "distinct_completions": len(set(completions)),
        "s_total": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-copies", type=int, default=48, help="most copies of the request in one batch")
    ap.add_argument("--max-fillers", type=int, default=8, help="most other requests mixed into one batch")
    ap.add_argument("--prompt-len", type=int, default=13)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--token-budget", type=int, default=128, help="max_num_batched_tokens (forces chunking)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1"
    os.environ["DEEPINFER_ENABLE_MTP_VARLEN"] = "0"
    torch.set_num_threads(args.threads)
    llm = _llm(args)
    records = [
        _study(llm, args, 0.0, distinct_seeds=False),
        _study(llm, args, args.temperature, distinct_seeds=False),
        _study(llm, args, args.temperature, distinct_seeds=True),  # control: must differ
    ]
    for r in records:
        r["expected"] = "many" if r["seq_seeds"] == "distinct" else 1
        r["ok"] = (
            r["distinct_completions"] > 1 if r["seq_seeds"] == "distinct" else r["distinct_completions"] == 1
        )
    table = Table(title="determinism study (deepinfer-tiny, paged runner, batch-invariant, async loop)")
    for col in ("temperature", "seq_seed", "requests", "rounds", "distinct", "expected", "ok", "s"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            f"{r['temperature']:g}",
            r["seq_seeds"],
            str(r["requests"]),
            str(r["rounds"]),
            str(r["distinct_completions"]),
            str(r["expected"]),
            str(r["ok"]),
            f"{r['s_total']:.0f}",
        )
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    llm.close()


if __name__ == "__main__":
    main()
