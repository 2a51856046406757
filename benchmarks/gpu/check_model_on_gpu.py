"""The whole V4.1 model on the GPU (weights, paged caches, every op) vs the CPU reference.

For each checkpoint: the model is loaded twice (CPU and CUDA, same activation dtype); a prompt is
prefilled through the `PagedRunner` with every position's logits (teacher forcing) and then decoded
greedily for `--steps` tokens, on both devices. Reports the relative error of the teacher-forced
logits, top-1 agreement, whether the greedy continuations agree, and the GPU wall time per step.

The CPU reference always runs the exact numerics (FP64 carrier). `--numerics exact,native` runs the GPU
model once per listed mode, with `DEEPINFER_NUMERICS` set for the GPU model only (native: FP32 carrier,
act-dtype GEMMs; see deepinfer_model.numerics), so one call reports native-vs-exact error and timing.

`--fp8-experts` sets `DEEPINFER_FP8_EXPERTS=1` for both the CPU reference and the GPU model: the MXFP4
routed experts are converted at load to 128x128-block FP8 and run by the `grouped_expert_mlp` op with
its FP8 activation casts (DeepGEMM on SM90, the CPU reference op on the CPU), so the two sides compute
the same numerics (without it the GPU and CPU models both keep the dequantised experts).

    python benchmarks/gpu/check_model_on_gpu.py --model tiny --model /tmp/medium --numerics exact,native --out DIR
writes `check_model_on_gpu.json` (one record per checkpoint, activation dtype and numerics mode).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


def run(model, ids: np.ndarray, steps: int, block_size: int = 16):
    """Teacher-forced logits of `ids` (one prefill step, every row) and `steps` greedy tokens after it."""
    from deepinfer_model.runner import StepBatch
    from deepinfer_model.runtime import PagedRunner

    blocks = -(-(len(ids) + steps) // block_size) + 1
    runner = PagedRunner(model, num_blocks=blocks, block_size=block_size)
    table = [np.arange(blocks, dtype=np.int32)]

    def step(tokens: np.ndarray, start: int, all_rows: bool) -> torch.Tensor:
        batch = StepBatch.of(
            seq_ids=np.zeros(1, dtype=np.int64),
            start_positions=np.array([start], dtype=np.int64),
            query_lens=np.array([len(tokens)], dtype=np.int64),
            block_tables=table,
            input_ids=tokens.astype(np.int64),
            logits_lens=np.array([len(tokens) if all_rows else 1], dtype=np.int64),
        )
        return runner.execute(batch)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    logits = step(ids, 0, True)
    sync()
    prefill_s = time.perf_counter() - t0
    out, pos, nxt = [], len(ids), int(logits[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(steps):
        out.append(nxt)
        nxt = int(step(np.array([nxt]), pos, False)[-1].argmax())
        pos += 1
    sync()
    return logits.double().cpu(), out, prefill_s, (time.perf_counter() - t0) / max(steps, 1)


@contextlib.contextmanager
def numerics_env(mode: str):
    """`DEEPINFER_NUMERICS=mode` for the block (read by the model at every call), restored afterwards."""
    saved = os.environ.get("DEEPINFER_NUMERICS")
    os.environ["DEEPINFER_NUMERICS"] = mode
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DEEPINFER_NUMERICS", None)
        else:
            os.environ["DEEPINFER_NUMERICS"] = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", action="append", default=None, help="'tiny' or a V4.1 checkpoint dir (repeatable)"
    )
    ap.add_argument("--tokens", type=int, default=64, help="teacher-forced prompt length")
    ap.add_argument("--steps", type=int, default=8, help="greedy decode steps")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="activation dtypes")
    ap.add_argument(
        "--numerics", default="exact", help="GPU model numerics modes, comma list of exact / native"
    )
    ap.add_argument(
        "--fp8-experts",
        action="store_true",
        help="DEEPINFER_FP8_EXPERTS=1 for the CPU reference and the GPU model (FP8 block routed experts)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=16, help="CPU threads for the reference")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = ap.parse_args()
    from deepinfer_model.models.deepseek_v41 import load_v41, make_v41_checkpoint

    modes = args.numerics.split(",")
    bad = [m for m in modes if m not in ("exact", "native")]
    if bad:
        ap.error(f"--numerics: {bad} not in exact, native")
    torch.set_num_threads(args.threads)
    # read at load time by both loads below; set (or cleared) here so an inherited value cannot make the
    # CPU reference and the GPU model differ in numerics
    os.environ["DEEPINFER_FP8_EXPERTS"] = "1" if args.fp8_experts else "0"
    recs = []
    for name in args.model or ["tiny"]:
        path = make_v41_checkpoint(tempfile.mkdtemp(), seed=0) if name == "tiny" else Path(name)
        cfg = json.loads((Path(path) / "config.json").read_text())["text_config"]
        rng = np.random.default_rng(1)
        ids = rng.integers(4, cfg["vocab_size"], args.tokens)
        for dt in args.dtypes.split(","):
            act = getattr(torch, dt)
            try:
                t0 = time.monotonic()
                with numerics_env("exact"):  # the reference: FP64 carrier on the CPU
                    ref, ref_greedy, cpu_prefill_s, cpu_step_s = run(
                        load_v41(path, act_dtype=act), ids, args.steps
                    )
                cpu_wall_s = time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - record and go on to the next checkpoint
                rec = dict(
                    check="v41_whole_model_on_gpu",
                    model=name,
                    act_dtype=dt,
                    fp8_experts=args.fp8_experts,
                    status=f"error: {e!r}"[:600],
                )
                print(rec, flush=True)
                recs.append(rec)
                continue
            for mode in modes:
                rec = dict(
                    check="v41_whole_model_on_gpu",
                    model=name,
                    hidden=cfg["hidden_size"],
                    act_dtype=dt,
                    numerics=mode,
                    fp8_experts=args.fp8_experts,
                )
                try:
                    with numerics_env(mode):
                        t1 = time.monotonic()
                        gpu_model = load_v41(path, act_dtype=act, device=args.device)
                        load_s = time.monotonic() - t1
                        run(gpu_model, ids[:8], 1)  # warm-up: kernel compiles, cached weight copies
                        got, got_greedy, prefill_s, step_s = run(gpu_model, ids, args.steps)
                        del gpu_model
                        torch.cuda.empty_cache()
                    rec.update(
                        status="ok",
                        tokens=args.tokens,
                        logits_rel_err=float((got - ref).norm() / ref.norm()),
                        logits_max_abs_err=float((got - ref).abs().max()),
                        finite=bool(torch.isfinite(got).all()),
                        teacher_forced_top1_agree=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                        greedy_steps=args.steps,
                        greedy_agree=got_greedy == ref_greedy,
                        gpu_load_s=round(load_s, 1),
                        gpu_prefill_ms=round(prefill_s * 1e3, 1),
                        gpu_decode_ms_per_step=round(step_s * 1e3, 2),
                        cpu_prefill_ms=round(cpu_prefill_s * 1e3, 1),
                        cpu_decode_ms_per_step=round(cpu_step_s * 1e3, 2),
                        cpu_wall_s=round(cpu_wall_s, 1),
                    )
                except Exception as e:  # noqa: BLE001 - record and go on to the next mode / checkpoint
                    rec["status"] = f"error: {e!r}"[:600]
                print(rec, flush=True)
                recs.append(rec)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check_model_on_gpu.json").write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
