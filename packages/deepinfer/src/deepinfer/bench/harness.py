"""`deepinfer bench prefill|decode|sweep`: Pareto sweeps with the reference's methodology.

One run measures prefill and decode in separate sections (each with its own engine sized for it),
writes the rows as JSON to `<results-dir>/<name>.json` (rewritten as each phase ends, so a later
failure keeps what was measured) and one Pareto PNG per phase next to it. The default results
directory, `benchmarks/out`, is untracked: the published results in `benchmarks/results` stay as
they are unless `--results-dir` points there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

CPU_CHUNKS, GPU_CHUNKS = "16,32,64,128", "4096,8192,16384,32768,65536"
CPU_BATCHES, GPU_BATCHES = "1,2,4,8", "8,16,32,64,128,256"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from ..engine_args import EngineArgs

    parser = argparse.ArgumentParser(
        prog="deepinfer bench",
        description="Prefill / decode Pareto benchmark. Modes: prefill, decode, sweep (both, one run). "
        "The offline throughput benchmark is `deepinfer bench [throughput] --num-requests N`.",
    )
    parser.add_argument("mode", choices=("prefill", "decode", "sweep"))
    g = parser.add_argument_group("prefill")
    g.add_argument(
        "--chunks", type=_int_list, default=None, help=f"chunk sizes (CPU {CPU_CHUNKS}; GPU {GPU_CHUNKS})"
    )
    g.add_argument(
        "--prefill-context", type=int, default=0, help="cached context before each chunk (default 0)"
    )
    g.add_argument("--prefill-warmup", type=int, default=1, help="untimed chunks per size (default 1)")
    g.add_argument("--prefill-repeats", type=int, default=3, help="timed chunks per size (default 3)")
    g = parser.add_argument_group("decode")
    g.add_argument(
        "--batches", type=_int_list, default=None, help=f"batch sizes (CPU {CPU_BATCHES}; GPU {GPU_BATCHES})"
    )
    g.add_argument("--decode-context", type=int, default=32, help="prompt tokens per request (default 32)")
    g.add_argument(
        "--nextn", type=int, default=None, help="draft tokens per step (default $DEEPINFER_USE_NEXTN_DECODE)"
    )
    g.add_argument(
        "--no-plain-baseline",
        action="store_true",
        help="with drafts on (nextn > 0), do not also decode the batches with drafts off (by default the "
        "drafted rows carry the plain run's tok/s and step time: plain_* and *_vs_plain keys)",
    )
    g.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps per batch (default 2)")
    g.add_argument("--measure-steps", type=int, default=8, help="timed decode steps per batch (default 8)")
    g.add_argument(
        "--accounting",
        choices=("full", "measured"),
        default="full",
        help="decode accounting on the plot's main series (both are in the JSON; default full)",
    )
    g = parser.add_argument_group("output, roofline, profiler")
    g.add_argument(
        "--results-dir",
        type=Path,
        default=Path("benchmarks/out"),
        help="where the JSON rows, PNGs and profiles go (default: %(default)s, untracked)",
    )
    g.add_argument("--name", default=None, help="file stem of the JSON / PNGs (default bench_<mode>)")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument(
        "--measure-ceilings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure copy bandwidth / matmul rate in-run (required on CPUs: no table row)",
    )
    g.add_argument(
        "--profile-prefill-chunk", type=int, default=None, help="profile one extra chunk of this size"
    )
    g.add_argument(
        "--profile-decode-batch",
        type=int,
        default=None,
        help="profile steps after this batch's window (use --no-async-scheduling: the async loop's forward runs on a worker thread the torch profiler does not record)",
    )
    g.add_argument("--profile-steps", type=int, default=2, help="decode steps under the profiler (default 2)")
    g.add_argument(
        "--profile-stacks",
        action="store_true",
        help="record Python frames in the profiles (benchmarks/gpu/trace_gaps.py then names the code around each device idle gap)",
    )
    g.add_argument(
        "--profile-dir", type=Path, default=None, help="traces go here (default <results-dir>/profiles)"
    )
    g.add_argument("--no-progress", action="store_true")
    parser.add_argument("--debug", action="store_true", help="print an error's traceback instead of one line")
    EngineArgs.add_cli_args(parser)
    return parser


def _on_gpu() -> bool:
    import torch

    from .. import envs

    return envs.DEEPINFER_ACCELERATOR == "nvidia" and torch.cuda.is_available()


def _engine(args, nextn: int | None = None, **overrides):
    """The benchmark's engine: --nextn drafts per step, or `nextn` (the plain baseline's 0). With
    several ranks (data / context / expert parallel) the data-parallel engine: its rank processes run the
    steps and report them."""
    from ..engine_args import EngineArgs

    base = dataclasses.replace(EngineArgs.from_cli_args(args), **overrides)
    if base.context_parallel_size > 1:  # its rows would count each group's tokens once per CP rank
        raise ValueError(
            f"deepinfer bench measures data and expert parallel layouts; context_parallel_size="
            f"{base.context_parallel_size} is not measured by it yet (use 1)"
        )
    nextn = args.nextn if nextn is None else nextn
    if base.world_size > 1:
        from ..engine.data_parallel import DataParallelEngine
        from ..reproducibility.ppl import nextn_decode

        # the ranks read the draft count from the environment they are spawned with
        if nextn is None:
            return DataParallelEngine(base)
        with nextn_decode(nextn):
            return DataParallelEngine(base)
    from ..engine.llm_engine import LLMEngine

    # --nextn goes to this engine only: setting the env var would leak into everything after us.
    return LLMEngine(base, num_speculative_tokens=nextn)


def _on_ranks(engine) -> bool:
    """The engine's steps run in rank processes (they report them as step traces)."""
    return hasattr(engine, "step_traces")


def _cost_model(engine, args):
    """The whole model, for the roofline's costs: the engine's own, or (rank processes hold theirs,
    experts sharded) the checkpoint loaded once here on the CPU."""
    if not _on_ranks(engine):
        return engine.model
    import torch
    from deepinfer_model import load_model

    return load_model(engine.model_path, getattr(torch, args.dtype))


def _runner_name(engine, args) -> str:
    return type(engine.runner).__name__ if not _on_ranks(engine) else f"{args.runner} (rank processes)"


def run(args) -> int:

    import torch
    from rich.console import Console
    from tqdm import tqdm

    from .drafts import compare_to_plain
    from .engine_driver import Driver
    from .intervals import FlagCounter
    from .phases import DecodeConfig, PrefillConfig, run_decode, run_prefill
    from .plot import plot_decode, plot_prefill
    from .rank_phases import decode_max_tokens as rank_decode_max_tokens
    from .rank_phases import run_decode_ranks, run_prefill_ranks
    from .roofline import decode_roof, machine_ceilings, model_costs, model_device, prefill_roof
    from .table import print_table

    console = Console(width=170)
    gpu = _on_gpu()
    if args.nextn is not None and args.nextn < 0:
        raise SystemExit("--nextn must be >= 0")
    from .. import envs

    nextn = args.nextn if args.nextn is not None else int(envs.DEEPINFER_USE_NEXTN_DECODE)
    cp = args.context_parallel_size
    chunks = args.chunks or _int_list(GPU_CHUNKS if gpu else CPU_CHUNKS)
    batches = args.batches or _int_list(GPU_BATCHES if gpu else CPU_BATCHES)
    name = args.name or f"bench_{args.mode}"
    profile_dir = args.profile_dir or args.results_dir / "profiles"
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    ceil_cache: dict = {}

    def ceilings_for(engine):
        """Ceilings of the device the engine's model runs on (rank 0's), measured once per run."""
        device = model_device(engine.model) if not _on_ranks(engine) else _rank0_device(args)
        if device.type not in ceil_cache:
            dtype = torch.bfloat16 if device.type == "cuda" else getattr(torch, args.dtype)
            ceil = machine_ceilings(device, dtype, measure=args.measure_ceilings)
            console.print(
                f"ceilings: {ceil.device}: {ceil.tflops:.3g} TFLOP/s, {ceil.tbps:.3g} TB/s ({ceil.source})"
            )
            ceil_cache[device.type] = ceil
        return ceil_cache[device.type]

    def common(ceil) -> dict:
        return {
            "device": ceil.device,
            "ceiling_tflops": ceil.tflops,
            "ceiling_tbps": ceil.tbps,
            "ceiling_source": ceil.source,
        }

    rows: list[dict] = []
    pngs = []
    out = args.results_dir / f"{name}.json"
    if args.mode in ("decode", "sweep"):  # checked before any engine is built
        decode_max_tokens = _decode_max_tokens(args, nextn, console)

    def save() -> None:
        """The rows so far, rewritten after each phase: a failure in the next one keeps them."""
        args.results_dir.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=2) + "\n")

    n_configs = (len(chunks) if args.mode != "decode" else 0) + (
        len(batches) if args.mode != "prefill" else 0
    )
    progress = tqdm(total=n_configs, desc="bench", disable=args.no_progress)
    t_start = time.perf_counter()
    if args.mode in ("prefill", "sweep"):
        engine = _engine(
            args,
            max_num_seqs=1,  # one chunk per step: the step is the chunk
            max_num_batched_tokens=max(chunks),
            max_model_len=args.prefill_context + max(chunks) + 1,
        )
        flags = FlagCounter()
        watched = flags.watch_all(engine)
        costs, ceil = model_costs(_cost_model(engine, args)), ceilings_for(engine)
        cfg = PrefillConfig(
            chunks=chunks,
            context=args.prefill_context,
            warmup=args.prefill_warmup,
            repeats=args.prefill_repeats,
            cp=cp,
            profile_chunk=args.profile_prefill_chunk,
            profile_dir=profile_dir,
            profile_stacks=args.profile_stacks,
        )
        try:
            if _on_ranks(engine):
                prows = run_prefill_ranks(Driver(engine, args.seed), cfg, progress)
            else:
                prows = run_prefill(Driver(engine, args.seed), cfg, flags, progress)
        finally:
            engine.close()
        for r in prows:
            _, roof = prefill_roof(costs, ceil, r["chunk_tokens"])
            r.update(common(ceil), model=str(engine.model_path), runner=_runner_name(engine, args))
            r.update(loop="async" if engine.use_async else "sync")
            r.setdefault("eplb_objects_watched", watched)
            r["roofline_tok_per_s_per_gpu"] = roof
            r["fraction_of_roofline"] = r["non_cached_tok_per_s_per_gpu"] / roof
        rows += prows
        save()
        if not args.no_plot:
            pngs.append(
                plot_prefill(
                    prows, args.results_dir / f"{name}_prefill.png", ceil, costs, _title("prefill", engine)
                )
            )
    if args.mode in ("decode", "sweep"):
        cfg = DecodeConfig(
            batches=batches,
            context=args.decode_context,
            nextn=nextn,
            warmup_steps=args.warmup_steps,
            measure_steps=args.measure_steps,
            cp=cp,
            profile_batch=args.profile_decode_batch,
            profile_steps=args.profile_steps,
            profile_dir=profile_dir,
            profile_stacks=args.profile_stacks,
            request_max_tokens=decode_max_tokens,
        )
        budget = (
            args.max_num_batched_tokens or 4096
        )  # (at most the engine's: it takes max(max_model_len, 4096))
        if args.data_parallel_size > 1:  # the ranks run each batch's requests to their end: no headroom
            dp = args.data_parallel_size
            max_len = cfg.context + max(rank_decode_max_tokens(cfg, b // dp, budget) for b in batches) + 1
        else:
            max_len = cfg.context + cfg.max_tokens() + 1
        blocks = -(-max_len // args.block_size) * max(batches) + 1
        sizes = dict(
            max_num_seqs=max(batches), max_model_len=max_len, num_kv_blocks=args.num_kv_blocks or blocks
        )
        engine = _engine(args, **sizes)
        effective = int(getattr(engine, "num_speculative_tokens", nextn))
        if effective != nextn:  # e.g. a checkpoint without draft blocks: account for what really runs
            console.print(
                f"[yellow]engine runs nextn={effective} (asked {nextn}); accounting uses {effective}[/]"
            )
            cfg.nextn = effective
        flags = FlagCounter()
        watched = flags.watch_all(engine)
        costs, ceil = model_costs(_cost_model(engine, args)), ceilings_for(engine)

        def decode(engine, cfg, flags, progress=None):
            if _on_ranks(engine):
                return run_decode_ranks(Driver(engine, args.seed), cfg, budget, progress)
            return run_decode(Driver(engine, args.seed), cfg, flags, progress)

        try:
            drows = decode(engine, cfg, flags, progress)
        finally:
            engine.close()
        if cfg.nextn and not args.no_plain_baseline:
            # the same batches decoded with drafts off, in this run: the drafted rows compare to them
            plain = _engine(args, nextn=0, **sizes)
            plain_cfg = dataclasses.replace(cfg, nextn=0, profile_batch=None)
            plain_flags = FlagCounter()
            plain_flags.watch_all(plain)
            try:
                prows = {r["batch"]: r for r in decode(plain, plain_cfg, plain_flags)}
            finally:
                plain.close()
            for r in drows:
                r.update(compare_to_plain(r, prows[r["batch"]]))
        for r in drows:
            _, roof = decode_roof(costs, ceil, r["batch"], cfg.nextn)
            r["nextn_requested"] = nextn
            r.update(common(ceil), model=str(engine.model_path), runner=_runner_name(engine, args))
            r.update(loop="async" if engine.use_async else "sync")
            r.setdefault("eplb_objects_watched", watched)
            r["roofline_tok_per_s_per_gpu"] = roof
            r["fraction_of_roofline"] = r["full_acceptance_tok_per_s_per_gpu"] / roof
        rows += drows
        save()
        if not args.no_plot:
            pngs.append(
                plot_decode(
                    drows,
                    args.results_dir / f"{name}_decode.png",
                    ceil,
                    costs,
                    _title("decode", engine),
                    args.accounting,
                )
            )
    progress.close()
    print_table(console, rows)
    save()
    console.print(
        f"wrote {out}" + "".join(f", {p}" for p in pngs) + f" ({time.perf_counter() - t_start:.1f}s)"
    )
    return 0


def model_position_limit(model: str | None) -> int | None:
    """The checkpoint's max_position_embeddings (top level or text_config), read without loading it."""
    from ..default_model import resolve_model

    path, _ = resolve_model(model)
    raw = json.loads((path / "config.json").read_text())
    limit = raw.get("max_position_embeddings") or raw.get("text_config", {}).get("max_position_embeddings")
    return int(limit) if limit else None


def _decode_max_tokens(args, nextn: int, console) -> int | None:
    """Tokens each decode request may generate, fitted to the model's context: the fill headroom
    (decode steps taken while the rest of a large batch is prefilled) shrinks to what fits, with a
    note; if even the measured steps do not fit, the run stops here, before any engine is built."""
    from .phases import DecodeConfig

    cfg = DecodeConfig(
        batches=[1],
        context=args.decode_context,
        nextn=nextn,
        warmup_steps=args.warmup_steps,
        measure_steps=args.measure_steps,
        profile_steps=args.profile_steps,
    )
    wanted = cfg.max_tokens()
    limits = [x for x in (args.max_model_len, model_position_limit(args.model)) if x]
    if not limits:
        return None
    limit = min(limits)
    room = limit - cfg.context - 1  # positions left for generated tokens
    if wanted <= room:
        return None
    needed = cfg.min_max_tokens()
    if needed > room:
        raise ValueError(
            f"decode needs {cfg.context} prompt + {needed} generated + 1 = {cfg.context + needed + 1} "
            f"positions per request ({cfg.measure_steps} measured, {cfg.warmup_steps} warm-up and "
            f"{cfg.profile_steps} profiled steps of 1 + nextn = {1 + nextn} tokens, 2 spare), but the "
            f"model allows {limit}: lower --decode-context, --measure-steps or --nextn"
        )
    console.print(
        f"[yellow]note:[/] the model allows {limit} positions; each decode request generates {room} "
        f"tokens instead of {wanted} (less fill headroom: a batch whose prefill spans many steps may not "
        "fit; lower --decode-context or --nextn if a request finishes inside the window)"
    )
    return room


def _rank0_device(args):
    """Where rank 0 of a data-parallel engine runs (rank_process.py: one GPU per rank, cuda:0 first)."""
    import torch

    from ..engine_args import EngineArgs

    device = EngineArgs.from_cli_args(args).torch_device
    return torch.device("cuda", 0) if device.type == "cuda" else device


def _title(phase: str, engine) -> str:
    loop = "async" if engine.use_async else "sync"
    return (
        f"deepinfer {phase}: {Path(str(engine.model_path)).name}, {type(engine.runner).__name__}, {loop} loop"
    )


def main(argv: list[str]) -> int:
    return run(build_parser().parse_args(argv))
