"""Multi-GPU checks and benchmarks of the V4.1 model: expert parallelism (EP), EPLB and
context-parallel (CP) prefill against the single-device run of the same invocation.

One invocation: the single-device reference runs in this process, then `--world` ranks are launched
(`run_distributed`: NCCL + spawn with rank r on cuda:r, NVLink multicast off; gloo + fork on the CPU)
and run, in order:

 a. equality - teacher-forced logits (and greedy continuations) of `--eq-prompts` prompts under
    EP=N with DP=N attention (each rank its own prompts, paged runner), under EP=N with redundant
    experts before and after an EPLB rebalance + weight shuffle, and under CP=N prefill (every rank all
    prompts), against the single device: max norm-wise relative error, top-1 and greedy-token
    agreement. The run exits 1 if one is beyond the tolerance of `multi_gpu_lib.tolerance` (bitwise on
    the CPU with exact numerics; 0.1 relative / 90% top-1 for BF16 on the GPU, why: its docstring).
 b. decode - tokens/s per GPU at EP=N for `--decode-batches` sequences per rank, with a skewed routing
    trace: `--hot-bias` is added to the selection bias of ceil(top_k/2) experts that rank 0 holds
    alone, so nearly every token picks them (reported: max/mean expert load). Without EPLB (no
    redundant experts) and with EPLB (`--redundant` slots, a live rebalance + weight shuffle in the
    middle of the timed steps); moe_lb (peak/mean rank load) before/after that step; the single
    device at the same batch is the baseline (ratio_vs_single).
 With deep_ep importable (NVIDIA), EP runs once more through DeepEP (`ep_deepep`: equality and decode).
 c. CP prefill - tokens/s per GPU of CP=N vs the single device at `--cp-lens` prompt lengths.

Timing: perf_counter after synchronising the device, warm-up steps excluded; a decode step ends when
its slowest rank ends. Writes benchmarks/out/bench_multi_gpu.json (bench_multi_gpu_cpu.json for
`--device cpu`), a list of flat records (`section`: equality / decode / cp_prefill).

    uv run --no-sync python benchmarks/parallel/bench_multi_gpu.py --model /tmp/medium --device cuda
    uv run --no-sync python benchmarks/parallel/bench_multi_gpu.py --model tiny --device cpu --world 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from deepinfer_cluster import envs
from deepinfer_parallel import deep_ep_available

sys.path.insert(0, str(Path(__file__).resolve().parent))
import multi_gpu_lib as lib  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# GPU: sized for a few minutes on the medium checkpoint (run_multi_gpu_suite.sh gives it 420 s)
GPU_DEFAULTS = dict(eq_len=128, greedy_steps=4, decode_batches="1,8,64", decode_prompt_len=64, warmup=3,
                    steps=16, cp_lens="1024,4096", cp_repeats=2, block_size=64)  # fmt: skip
CPU_DEFAULTS = dict(eq_len=40, greedy_steps=3, decode_batches="1,4", decode_prompt_len=12, warmup=2,
                    steps=6, cp_lens="48,96", cp_repeats=1, block_size=16)  # fmt: skip


def ints(text: str, name: str, low: int = 1) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise SystemExit(f"{name}: expected a comma list of integers, got {text!r}") from exc
    if not vals or min(vals) < low:
        raise SystemExit(f"{name}: every value must be an integer >= {low}, got {text!r}")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="tiny", help="'tiny' (the §11 checkpoint, generated) or a V4.1 checkpoint dir"
    )
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--world", type=int, default=None, help="ranks (default: the GPU count, 2 on the CPU)")
    ap.add_argument(
        "--dtype",
        choices=tuple(lib.DTYPES),
        default=None,
        help="activation dtype (default: bfloat16 on cuda, float32 on cpu)",
    )
    ap.add_argument(
        "--numerics",
        choices=("exact", "native"),
        default=None,
        help="DEEPINFER_NUMERICS for every run (default: the environment's, else exact)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size (>= 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed decode steps before them")
    ap.add_argument(
        "--eq-prompts", type=int, default=None, help="equality prompts (multiple of --world; default 2*world)"
    )
    ap.add_argument("--eq-len", type=int, default=None, help="longest equality prompt (others are shorter)")
    ap.add_argument("--greedy-steps", type=int, default=None, help="greedy tokens compared per prompt")
    ap.add_argument("--decode-batches", default=None, help="sequences per rank, comma list")
    ap.add_argument("--decode-prompt-len", type=int, default=None)
    ap.add_argument("--cp-lens", default=None, help="CP prefill prompt lengths, comma list")
    ap.add_argument("--cp-repeats", type=int, default=None, help="timed prefills per length")
    ap.add_argument(
        "--redundant",
        type=int,
        default=None,
        help="redundant expert slots of the EPLB runs (default: n_routed/4, rounded up to divisibility)",
    )
    ap.add_argument("--hot-bias", type=float, default=10.0, help="selection bias added to the hot experts")
    ap.add_argument("--block-size", type=int, default=None, help="paged KV block size")
    ap.add_argument(
        "--no-deepep",
        action="store_true",
        help="skip the DeepEP variants (run by default when deep_ep imports)",
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for the parallel runs")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out", help="results directory")
    args = ap.parse_args(argv)
    d = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key, value in d.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    if args.world is None:
        args.world = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.world < 2:
        ap.error(f"--world must be >= 2 (got {args.world})")
    if args.device == "cuda" and args.world > torch.cuda.device_count():
        ap.error(f"--world {args.world} > {torch.cuda.device_count()} visible GPUs")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.numerics is None:  # the environment's setting, validated by the registry (unset: exact)
        try:
            args.numerics = envs.DEEPINFER_NUMERICS
        except ValueError as e:
            ap.error(str(e))
    args.eq_prompts = args.eq_prompts or 2 * args.world
    if args.eq_prompts % args.world:
        ap.error(f"--eq-prompts ({args.eq_prompts}) must be a multiple of --world ({args.world})")
    for name in (
        "steps",
        "warmup",
        "eq_len",
        "greedy_steps",
        "decode_prompt_len",
        "cp_repeats",
        "block_size",
    ):
        low = {"steps": 4, "warmup": 0}.get(name, 1)
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.eq_len < 8:
        ap.error(f"--eq-len must be >= 8, got {args.eq_len}")
    return args


def build_settings(args, work_dir: Path) -> lib.Settings:
    """Resolve the checkpoint, the redundant-slot count and the hot experts."""
    from deepinfer_model.models.deepseek_v41 import DeepseekV41Config, make_v41_checkpoint
    from deepinfer_parallel import num_redundant_experts

    if args.model == "tiny":
        path = make_v41_checkpoint(work_dir / "tiny", seed=0)
    else:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model: {path} is not a checkpoint directory (no config.json)")
    cfg = DeepseekV41Config.from_file(path)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    minimum = args.redundant if args.redundant is not None else max(1, e // 4)
    if minimum < 0:
        raise SystemExit(f"--redundant must be >= 0, got {minimum}")
    redundant = num_redundant_experts(e, args.world, minimum=minimum)
    if e % args.world:
        raise SystemExit(f"n_routed_experts={e} is not divisible by --world {args.world}: the EP run without "
                         "redundant experts needs it")  # fmt: skip
    n = args.eq_prompts
    # varied lengths between eq_len/2 and eq_len (odd and even: CP mirror pieces with padding rows)
    lens = [args.eq_len - (i * 7) % max(1, args.eq_len // 2) for i in range(n)]
    too_long = [
        x
        for x in lens + ints(args.cp_lens, "--cp-lens")
        if x + args.greedy_steps > cfg.max_position_embeddings
    ]
    if too_long:
        raise SystemExit(
            f"prompt lengths {too_long} exceed max_position_embeddings={cfg.max_position_embeddings}"
        )
    return lib.Settings(
        model_path=str(path), model_name=args.model if args.model == "tiny" else path.name,
        device=args.device, world=args.world, dtype=args.dtype, numerics=args.numerics,
        eq_lens=lens, greedy_steps=args.greedy_steps,
        decode_batches=ints(args.decode_batches, "--decode-batches"),
        decode_prompt_len=args.decode_prompt_len, warmup=args.warmup, steps=args.steps,
        redundant=redundant, hot_experts=lib.hot_expert_ids(e, k, redundant, args.world),
        hot_bias=args.hot_bias, cp_lens=ints(args.cp_lens, "--cp-lens"), cp_repeats=args.cp_repeats,
        block_size=args.block_size, work_dir=str(work_dir),
        deepep=args.device == "cuda" and not args.no_deepep and deep_ep_available(),
    )  # fmt: skip


def run(
    s: lib.Settings, timeout_s: float = 3600.0, progress: bool = True, partial_out: Path | None = None
) -> list[dict]:
    """The whole benchmark: the single-device reference here, then the parallel ranks. Returns the
    records (equality, decode and cp_prefill; parallel records carry ratio_vs_single). With
    `partial_out`, rank 0 rewrites that file with the records so far after every phase."""
    s.partial_out = str(partial_out) if partial_out else None
    from deepinfer_parallel.launch import run_distributed

    os.environ["DEEPINFER_NUMERICS"] = s.numerics  # read at every call, here and in the ranks
    Path(s.work_dir).mkdir(parents=True, exist_ok=True)
    settings_path = Path(s.work_dir) / "settings.json"
    s.save(settings_path)
    threads = torch.get_num_threads()
    if s.device == "cpu":
        torch.set_num_threads(1)  # like each rank (run_distributed): per-process rates compare
    try:
        t0 = time.perf_counter()
        single = lib.reference(s, progress=progress)
        (Path(s.work_dir) / "single.json").write_text(json.dumps(single))
        t1 = time.perf_counter()
        if progress:
            print(
                f"single-device reference and baselines: {t1 - t0:.1f} s; launching {s.world} ranks",
                flush=True,
            )
        backend, start = ("nccl", "spawn") if s.device == "cuda" else ("gloo", "fork")
        run_distributed(lib.rank_main, s.world, str(settings_path), backend=backend, start_method=start,
                        timeout_s=timeout_s)  # fmt: skip
        if progress:
            print(f"parallel runs: {time.perf_counter() - t1:.1f} s", flush=True)
    finally:
        torch.set_num_threads(threads)
    parallel = json.loads((Path(s.work_dir) / "ranks.json").read_text())
    return lib.merge(single, parallel, s)


def _f(x, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float) and math.isnan(x):
        return "-"
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def print_tables(records: list[dict], s: lib.Settings) -> None:
    from rich.console import Console
    from rich.table import Table

    # piped output (a log file, CI) would be cut to 80 columns; a terminal keeps its own width
    con = Console() if sys.stdout.isatty() else Console(width=220)
    eq = [r for r in records if r["section"] == "equality"]
    t = Table(title=f"a. equality vs single device ({s.device}, {s.dtype}, {s.numerics}, world {s.world})")
    for c in ("variant", "prompts", "tokens", "max rel err", "max abs err", "top-1 agree", "greedy agree",
              "bitwise", "tolerance", "passed"):  # fmt: skip
        t.add_column(c)
    for r in eq:
        tol = "bitwise" if r["exact_required"] else f"rel<={r['rel_tol']:g}, top1>={r['top1_min']:g}"
        t.add_row(r["variant"], str(r["prompts"]), str(r["tokens"]), _f(r["max_rel_err"]), _f(r["max_abs_err"]),
                  _f(r["top1_agree"], ".4f"), _f(r["greedy_agree"], ".4f"), _f(r["bitwise_equal"]), tol,
                  _f(r["passed"]))  # fmt: skip
    con.print(t)
    dec = [r for r in records if r["section"] == "decode"]
    hot = s.hot_experts
    t = Table(title=f"b. decode, skewed routing (hot experts {hot}, bias +{s.hot_bias:g}), tok/s per GPU")
    for c in (
        "variant",
        "batch/rank",
        "redundant",
        "us/step",
        "tok/s/GPU",
        "x single",
        "expert max/mean",
        "moe_lb before",
        "moe_lb after",
        "tok/s/GPU before",
        "tok/s/GPU after",
        "rebalance ms",
        "MiB moved",
    ):
        t.add_column(c)  # fmt: skip
    for r in sorted(dec, key=lambda r: (r["batch_per_rank"], r["variant"] != "single", r["variant"])):
        t.add_row(r["variant"], str(r["batch_per_rank"]), _f(r.get("redundant", "-")), _f(r["us_per_step"], ".0f"),
                  _f(r["tok_per_s_per_gpu"], ".1f"), _f(r.get("ratio_vs_single", float("nan")), ".2f"),
                  _f(r.get("expert_load_max_over_mean", float("nan")), ".2f"),
                  _f(r.get("moe_lb_before", float("nan")), ".2f"), _f(r.get("moe_lb_after", float("nan")), ".2f"),
                  _f(r.get("tok_per_s_per_gpu_before", float("nan")), ".1f"),
                  _f(r.get("tok_per_s_per_gpu_after", float("nan")), ".1f"),
                  _f(r["rebalance_ms"], ".1f") if r.get("rebalanced") else "-",
                  _f(r["rebalance_bytes_moved"] / 2**20, ".1f") if r.get("rebalanced") else "-")  # fmt: skip
    con.print(t)
    cp = [r for r in records if r["section"] == "cp_prefill"]
    t = Table(title="c. prefill: CP vs single device")
    for c in ("variant", "GPUs", "prompt tokens", "ms/prefill", "tok/s/GPU", "x single"):
        t.add_column(c)
    for r in sorted(cp, key=lambda r: (r["prompt_tokens"], r["gpus"])):
        t.add_row(r["variant"], str(r["gpus"]), str(r["prompt_tokens"]), _f(r["ms_per_prefill"], ".1f"),
                  _f(r["tok_per_s_per_gpu"], ".1f"), _f(r.get("ratio_vs_single", float("nan")), ".2f"))  # fmt: skip
    con.print(t)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "bench_multi_gpu.json" if args.device == "cuda" else "bench_multi_gpu_cpu.json"
    with tempfile.TemporaryDirectory(prefix="bench_multi_gpu_") as tmp:
        s = build_settings(args, Path(tmp))
        records = run(s, timeout_s=args.timeout, partial_out=args.out / name)
    print_tables(records, s)
    (args.out / name).write_text(json.dumps(lib.json_safe(records), indent=1))
    print(f"wrote {args.out / name}")
    failed = [r["variant"] for r in records if r["section"] == "equality" and not r["passed"]]
    if failed:
        print(
            f"FAILED equality: {failed} beyond the tolerance (see multi_gpu_lib.tolerance)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
