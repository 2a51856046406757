"""`deepinfer` command line: generate, chat-free offline runs, bench, launch, eval."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from .engine_args import EngineArgs


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (defaults for every request; an input line may override)")
    g.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per sample (default: 16)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--seq-seed", type=int, default=None, help="per-request random seed (reproducible draws)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    g.add_argument(
        "--logprobs", type=int, default=None, help="return logprobs with this many top alternatives"
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer", description="DeepInfer: offline inference for DeepSeek-V4.1-class MoE models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate text for prompts",
        description="Generate completions for --prompt strings or a JSONL file of requests. Each input line is "
        '{"prompt": str} or {"prompt_token_ids": [int]} or {"messages": [{"role", "content"}]}, optionally '
        'with "sampling_params": {...} and "id".',
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--input", type=Path, help="JSONL file of requests")
    gen.add_argument("--output", type=Path, help="write one JSON result per line here")
    gen.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    _sampling_args(gen)
    EngineArgs.add_cli_args(gen)

    bench = sub.add_parser(
        "bench",
        help="benchmarks: [throughput] | prefill | decode | sweep",
        description="Offline throughput (sync vs async loop). `deepinfer bench prefill|decode|sweep --help`: "
        "Pareto sweeps (deepinfer.bench.harness).",
    )
    from .bench import add_bench_args

    add_bench_args(bench)
    EngineArgs.add_cli_args(bench)

    sub.add_parser("launch", help="multi-process launch (deepinfer_cluster.launch)", add_help=False)
    sub.add_parser(
        "eval", help="AIME / HLE / GPQA evaluation (runs the deepinfer-eval command)", add_help=False
    )
    return parser


def _read_requests(args) -> list[dict]:
    if args.prompt:
        return [{"prompt": p} for p in args.prompt]
    requests = []
    for lineno, line in enumerate(args.input.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"deepinfer generate: {args.input}:{lineno}: invalid JSON: {e}") from None
        if not isinstance(record, dict) or not ({"prompt", "prompt_token_ids", "messages"} & record.keys()):
            raise SystemExit(
                f"deepinfer generate: {args.input}:{lineno}: needs a 'prompt', 'prompt_token_ids' or 'messages' key"
            )
        requests.append(record)
    return requests


def cmd_generate(args) -> int:
    from rich.console import Console

    from .default_model import RANDOM_WEIGHTS_NOTICE
    from .llm import LLM
    from .summary import summary_table

    console = Console(stderr=True)
    requests = _read_requests(args)
    defaults = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        n=args.n,
        seq_seed=args.seq_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    engine_args = EngineArgs.from_cli_args(args)
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    if llm.engine.is_default_model:
        console.print(f"[bold yellow]note:[/] {RANDOM_WEIGHTS_NOTICE}")
    console.print(f"model {llm.engine.model_path} loaded in {time.perf_counter() - t0:.1f}s")

    prompts, token_ids, params = [], [], []
    for r in requests:
        if "messages" in r:
            from .tokenizer import render_chat

            prompts.append(render_chat(r["messages"], llm.engine.tokenizer_config))
            token_ids.append(None)
        else:
            prompts.append(r.get("prompt"))
            token_ids.append(r.get("prompt_token_ids"))
        params.append({**defaults, **r.get("sampling_params", {})})
    # encode here so each request may give text or ids; a bad one fails alone inside generate
    ids = []
    for p, t in zip(prompts, token_ids):
        ids.append(t if t is not None else (llm.engine.encode(p) if isinstance(p, str) else []))
    start = time.perf_counter()
    try:
        outputs = llm.generate(
            prompts, params, prompt_token_ids=ids, use_tqdm=not args.no_progress, raise_on_error=False
        )
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: in-flight requests aborted")
        return 130
    finally:
        llm.close()
    elapsed = time.perf_counter() - start

    if args.output:
        with args.output.open("w") as f:
            for r, out in zip(requests, outputs):
                record = out.to_json()
                if "id" in r:
                    record["id"] = r["id"]
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        for out in outputs:
            if out.error:
                print(f"[request {out.request_id}] error: {out.error}")
            for c in out.outputs:
                print(c.text if len(out.outputs) == 1 else f"[{c.index}] {c.text}")
    console.print(summary_table(outputs, elapsed, llm.engine))
    return 0 if all(o.error is None for o in outputs) else 1


def run_deepinfer_eval(args: list[str]) -> int:
    """`deepinfer eval ARGS` runs `deepinfer-eval ARGS` in a child of this interpreter and returns its exit
    status. deepinfer-eval depends on the engine (its `generate` extra), so the engine hands over to
    its command instead of importing it: the two packages form no import cycle."""
    if importlib.util.find_spec("deepinfer_eval") is None:
        print(
            "deepinfer eval needs the deepinfer-eval package: pip install 'deepinfer-eval[generate]'",
            file=sys.stderr,
        )
        return 2
    child = subprocess.Popen([sys.executable, "-m", "deepinfer_eval", *args])
    while True:
        try:
            code = child.wait()
        except KeyboardInterrupt:
            continue  # the child got the same interrupt; it decides how to stop (a stage is resumable)
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        from deepinfer_cluster.launch import main as launch_main

        return launch_main(argv[1:])
    if argv and argv[0] == "eval":
        return run_deepinfer_eval(argv[1:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in ("prefill", "decode", "sweep"):
        from .bench.harness import main as harness_main

        return harness_main(argv[1:])
    if argv[:2] == ["bench", "throughput"]:
        argv = ["bench"] + argv[2:]
    args = _build_parser().parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
