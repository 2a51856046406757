"""Where the engine makes the host wait for the GPU during a prefill: every synchronizing CUDA call, by call site.

A host sync drains the GPU's queue; whatever the host launches next runs with the device idle until the host
is ahead again, which is where the idle gaps of `trace_gaps.py` come from. This script runs one warm-up
request of `--tokens` prompt tokens through `LLM.generate`, then one more of the same length (each with a
new prompt, so no prefix is cached), then a third under `torch.cuda.set_sync_debug_mode("warn")`, and lists each synchronizing call (a device->host copy, `.item()`,
`.tolist()`, `nonzero`, a pageable host->device copy, ...) by the innermost frame in our packages, with the
frames above it and how many times per request it ran.

    python benchmarks/gpu/find_host_syncs.py --model /tmp/medium-v41 [--tokens 16384] [--max-tokens 1]
writes benchmarks/out/find_host_syncs.json (one record per call site).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parents[1] / "out"
OURS = ("deepinfer_model", "deepinfer_sched", "deepinfer_spec", "deepinfer_structured", "deepinfer/")


def _site(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(innermost frame in our packages, up to three of our frames above it)."""
    ours = [f for f in stack if any(p in f.filename for p in OURS)]
    if not ours:
        return "(outside our packages)", ""

    def name(f):
        path = f.filename.split("/src/", 1)[-1]
        return f"{path}:{f.lineno} {f.name}"

    return name(ours[-1]), " < ".join(name(f) for f in reversed(ours[-4:-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--tokens", type=int, default=16384, help="prompt tokens of the request (default 16384)")
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens to generate (1: the prefill only)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=str(RESULTS / "find_host_syncs.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("find_host_syncs.py needs CUDA: host syncs exist only between the host and a GPU")
    if args.tokens < 1 or args.max_tokens < 1:
        raise SystemExit("--tokens and --max-tokens must be >= 1")

    from deepinfer import LLM, SamplingParams
    from rich.console import Console
    from rich.table import Table

    llm = LLM(
        model=args.model,
        max_model_len=args.tokens + args.max_tokens,
        max_num_seqs=1,
        max_num_batched_tokens=args.tokens,
        device="cuda",
        dtype=args.dtype,
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def request() -> float:
        prompt = rng.integers(1000, 90_000, args.tokens).tolist()  # a new prompt: no cached prefix
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        if len(out[0].outputs[0].token_ids) != args.max_tokens:
            raise SystemExit(f"the request returned {out[0].outputs[0]!r}")
        return (time.perf_counter() - t0) * 1e3

    warm_ms = request()  # kernel compiles, weight caches
    plain_ms = request()
    sites: Counter = Counter()
    above: dict[tuple[str, str], str] = {}
    seen_show = warnings.showwarning  # (catch_warnings puts it back on exit)

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return seen_show(message, category, filename, lineno, file, line)
        site, callers = _site(traceback.extract_stack()[:-1])
        key = (site, str(message).split("\n")[0][:80])
        sites[key] += 1
        above.setdefault(key, callers)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            debug_ms = request()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    records = [
        {"site": site, "message": msg, "callers": above[(site, msg)], "syncs_per_request": n,
         "tokens": args.tokens, "max_tokens": args.max_tokens}
        for (site, msg), n in sites.most_common()
    ]  # fmt: skip
    table = Table(
        title=f"host syncs in one request of {args.tokens} prompt tokens, {args.max_tokens} generated"
    )
    for col in ("syncs", "site", "called from"):
        table.add_column(col)
    for r in records:
        table.add_row(str(r["syncs_per_request"]), r["site"], r["callers"])
    Console(width=200).print(table)
    print(
        f"request wall ms: warm-up {warm_ms:.1f}, plain {plain_ms:.1f}, under sync debug {debug_ms:.1f}; "
        f"{sum(sites.values())} syncs at {len(sites)} sites"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
