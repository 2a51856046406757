"""Load test of `deepinfer serve` on loopback, next to the offline engine on the same workload.

    uv run --all-packages python benchmarks/engine/bench_server.py --num-requests 1000 --concurrency 64

The workload: --num-requests requests with random token-id prompts and output lengths (ignore_eos, each
its own seed, sampled at temperature 0.8). The offline `LLM.generate` runs it first; then a `deepinfer
serve` child process (same engine flags) gets it from --concurrency streaming clients at once (the
official `openai` client). Checked, and a failure exits 1: every request answered exactly once, every
stream complete (one finish reason, usage, [DONE]), each text equal to the offline text of the same
request, the server's own count of finished requests equal to the number sent. Reported: tokens/s of
both and their ratio, the clients' TTFT and inter-token latency percentiles. The server never runs more
requests at once than there are clients, while the offline engine batches up to --max-num-seqs: a second
offline run with --max-num-seqs set to --concurrency (when lower) gives the engine's own throughput at
the clients' width, and server_vs_offline_at_concurrency the part of the gap the server's path adds. A table on stdout and a flat
JSON (--output-dir, default benchmarks/out/, untracked). The run stops by itself: the requests are
bounded and --time-limit-s bounds the whole server phase. Engine flags (--model, --max-num-seqs, ...)
apply to both; without --model it runs the built-in deepinfer-tiny.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from deepinfer.engine_args import EngineArgs

OUT_DIR = Path(__file__).resolve().parents[1] / "out"


@dataclasses.dataclass
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    seed: int


def workload(args, vocab_size: int) -> list[Request]:
    rng = random.Random(args.workload_seed)
    return [
        Request(
            i,
            [rng.randrange(1, vocab_size) for _ in range(rng.randint(*args.input_len))],
            rng.randint(*args.output_len),
            args.workload_seed * 1_000_003 + i,
        )
        for i in range(args.num_requests)
    ]


def run_offline(engine_args: EngineArgs, requests: list[Request]) -> tuple[list[str], int, float]:
    from deepinfer import LLM, SamplingParams

    with LLM(**engine_args.fields()) as llm:
        params = [
            SamplingParams(max_tokens=r.max_tokens, temperature=0.8, seq_seed=r.seed, ignore_eos=True)
            for r in requests
        ]
        llm.generate(
            prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
        )
        t0 = time.perf_counter()
        outs = llm.generate(
            prompt_token_ids=[r.prompt for r in requests], sampling_params=params, use_tqdm=False
        )
        elapsed = time.perf_counter() - t0
    return [o.outputs[0].text for o in outs], sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def engine_flags(engine_args: EngineArgs) -> list[str]:
    flags = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(engine_args, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def start_server(engine_args: EngineArgs, timeout_s: float) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "deepinfer.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd + engine_flags(engine_args), stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            url = m.group(1)
            while time.monotonic() < deadline:  # the socket is bound; wait until the app answers
                try:
                    urllib.request.urlopen(url + "/health", timeout=5)
                    return proc, url
                except OSError:
                    time.sleep(0.1)
    proc.kill()
    raise SystemExit("bench_server: the server did not start")


async def run_clients(url: str, model: str, requests: list[Request], concurrency: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    results: dict[int, dict] = {}
    duplicates = []

    async def one(r: Request) -> None:
        async with gate:
            t0 = time.perf_counter()
            stamps, text, finishes, usage = [], [], [], None
            stream = await client.completions.create(
                model=model, prompt=r.prompt, max_tokens=r.max_tokens, temperature=0.8, seed=r.seed,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for c in chunk.choices:
                    if c.text:
                        stamps.append(time.perf_counter())
                        text.append(c.text)
                    if c.finish_reason:
                        finishes.append(c.finish_reason)
        if r.index in results:
            duplicates.append(r.index)
        results[r.index] = {
            "text": "".join(text),
            "finishes": finishes,
            "usage": usage,
            "t0": t0,
            "stamps": stamps,
        }

    t0 = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    return {"results": results, "duplicates": duplicates, "elapsed": time.perf_counter() - t0}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": q[49], "p90": q[89], "p99": q[98], "mean": statistics.fmean(values)}


def server_finished(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("deepinfer_request_success_total")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64, help="streaming clients at once")
    parser.add_argument("--input-len", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    parser.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the prompts, lengths and request seeds"
    )
    parser.add_argument(
        "--time-limit-s", type=float, default=3600, help="the server phase is stopped after this"
    )
    parser.add_argument("--output-dir", type=Path, default=OUT_DIR)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)

    from deepinfer.default_model import resolve_model

    # (engine_args.model stays as given: the built-in model keeps its defaults, drafts off)
    model_path, _ = resolve_model(engine_args.model)
    vocab = json.loads((model_path / "config.json").read_text())
    vocab_size = vocab.get("vocab_size") or vocab.get("text_config", {}).get("vocab_size")
    requests = workload(args, int(vocab_size))

    offline_texts, offline_tokens, offline_s = run_offline(engine_args, requests)
    narrow_tok_per_s = offline_tokens / offline_s
    if args.concurrency < engine_args.max_num_seqs:
        narrow = dataclasses.replace(engine_args, max_num_seqs=args.concurrency)
        _, narrow_tokens, narrow_s = run_offline(narrow, requests)
        narrow_tok_per_s = narrow_tokens / narrow_s
    proc, url = start_server(engine_args, timeout_s=600)
    try:
        run = asyncio.run(
            asyncio.wait_for(
                run_clients(url, engine_args.served_model_name, requests, args.concurrency), args.time_limit_s
            )
        )
        finished_on_server = server_finished(url)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()

    results = run["results"]
    lost = [r.index for r in requests if r.index not in results]
    incomplete = [i for i, x in results.items() if len(x["finishes"]) != 1 or x["usage"] is None]
    mismatched = [i for i, x in results.items() if x["text"] != offline_texts[i]]
    server_tokens = sum(x["usage"] or 0 for x in results.values())
    ttft = [x["stamps"][0] - x["t0"] for x in results.values() if x["stamps"]]
    itl = [b - a for x in results.values() for a, b in zip(x["stamps"], x["stamps"][1:])]
    record = {
        "model": str(model_path),
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "input_len_min": args.input_len[0],
        "input_len_max": args.input_len[1],
        "output_len_min": args.output_len[0],
        "output_len_max": args.output_len[1],
        "offline_tokens": offline_tokens,
        "offline_s": offline_s,
        "offline_tok_per_s": offline_tokens / offline_s,
        "server_tokens": server_tokens,
        "server_s": run["elapsed"],
        "server_tok_per_s": server_tokens / run["elapsed"],
        "server_vs_offline": (server_tokens / run["elapsed"]) / (offline_tokens / offline_s),
        "offline_at_concurrency_tok_per_s": narrow_tok_per_s,
        "server_vs_offline_at_concurrency": (server_tokens / run["elapsed"]) / narrow_tok_per_s,
        "lost": len(lost),
        "duplicated": len(run["duplicates"]),
        "incomplete": len(incomplete),
        "text_mismatches": len(mismatched),
        "server_finished_requests": finished_on_server,
        **{f"ttft_s_{k}": v for k, v in percentiles(ttft).items()},
        **{f"itl_s_{k}": v for k, v in percentiles(itl).items()},
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    out = args.output_dir / "bench_server.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    width = max(len(k) for k in record)
    for k, v in record.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    print(f"written to {out}")
    ok = (
        not (lost or run["duplicates"] or incomplete or mismatched)
        and finished_on_server == args.num_requests
    )
    if not ok:
        print(f"FAILED: lost {lost[:5]}, duplicated {run['duplicates'][:5]}, incomplete {incomplete[:5]}, "
              f"mismatched {mismatched[:5]}, server finished {finished_on_server}", file=sys.stderr)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
