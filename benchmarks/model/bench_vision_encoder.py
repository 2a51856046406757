"""The V4.1-Flash vision encoder on one device: ms/image, images/s and MFU at 256 / 576 / 1,024 tokens per image.

Random weights of the real encoder config (32 layers, width 1024, 16 heads of 64, SwiGLU 2,816, 14 x 14
patches, 3 x 3 pixel-unshuffle; the aligner to `--text-hidden`) are drawn on the device, so no checkpoint is
needed; `--layers` shrinks the encoder for a CPU smoke run. An image of C tokens is a square grid of C merged
cells, (3 sqrt C)^2 patches (1,024 tokens: 9,216 patches). Each variant (attention x math dtype, see
`vision/encoder.py`) encodes one image at a time through `VisionTower.embed_image`: `--warmup` calls, then
`--repeats` timed calls (CUDA events on a GPU, the host clock on the CPU), median. The baseline is the einsum
reference attention in FP32, measured in the same run: `speedup_vs_reference_fp32`, and each variant's output
against the baseline's (`rel_err_vs_reference_fp32`, relative Frobenius), so a fast wrong variant shows. On
CUDA each variant also records `peak_extra_mem_gib` (memory its first call allocated beyond the weights: the
einsum path's [heads, N, N] scores show there) and `attention_kernel` (the attention kernel one profiled call
ran: FlashAttention / memory-efficient / cuDNN for the fused path, "none" for the einsum path).

FLOPs per image count matrix products only (2 per multiply-add; norms, RoPE, softmax and GELU left out), with
P patches, W width, I SwiGLU width, L layers, r the unshuffle side, M = P / r^2 merged cells, d text width:
    patch embedding 2 P (3 p^2) W
    per layer: QKV 2 P W (3W) + attention 4 P^2 W (QK^T and PV, all heads) + projection 2 P W^2
               + SwiGLU 2 P W (2I) + 2 P I W
    aligner 2 M (r^2 W) d + 2 M d^2
`mfu_pct` divides the achieved rate by the device's dense BF16 peak (`deepinfer_cluster.peak_rates`, the
datasheet; on the CPU or an unknown device, the measured GEMM rate); `pct_of_measured_gemm` by a square BF16
GEMM timed in the same run (FP32 on the CPU).

`--model PATH` (a V4.1 checkpoint directory, e.g. the medium one) also times the language model's prefill of
the positions one image takes in the prompt, `rows * (cols + 1) + 2` (start, newlines, end), as one chunk of
a fresh sequence on a `PagedRunner` (the step ends with the greedy token read back), BF16 activations; text ids
stand in for the image's (its features enter at the embedding, which costs nothing beside the layers). Its
`mfu_pct` counts the model's matrix FLOPs per token (`deepinfer.bench.roofline.model_costs`, attention left
out), against the same peak.

    python benchmarks/model/bench_vision_encoder.py [--device cuda] [--cells 256 576 1024] [--model PATH]
    python benchmarks/model/bench_vision_encoder.py --device cpu --layers 2 --cells 4 16 --repeats 3   # smoke run
writes benchmarks/out/bench_vision_encoder.json (`--json PATH`): flat records, one per configuration
(`section` "encoder": one per image size and variant; "lm_prefill": one per image size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "out" / "bench_vision_encoder.json"
COMMITTED = ROOT / "benchmarks" / "results"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BASELINE = "reference:float32"
DEFAULT_VARIANTS = ["fused:bfloat16", "fused:float32", "reference:bfloat16", BASELINE]
_ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|attn|sdpa|cudnn", re.IGNORECASE)


def flash_vision_config(layers: int = 32):
    """The V4.1-Flash encoder and aligner (issue 49's facts), with `layers` blocks."""
    from deepinfer_model.models.deepseek_v41.vision import VisionConfig

    return VisionConfig(
        hidden_size=1024,
        downsample_ratio=3,
        num_hidden_layers=layers,
        num_attention_heads=16,
        intermediate_size=2816,
        patch_size=14,
    )


def encoder_flops(vcfg, cells: int, text_hidden: int) -> dict[str, float]:
    """Matrix FLOPs of one image of `cells` merged cells, by part (the formula in the module doc)."""
    r, W, inter, L = vcfg.downsample_ratio, vcfg.hidden_size, vcfg.intermediate_size, vcfg.num_hidden_layers
    P, M, d = cells * r * r, cells, text_hidden
    parts = {
        "patch_embed": 2 * P * vcfg.patch_dim * W,
        "qkv": L * 2 * P * W * 3 * W,
        "attention": L * 4 * P * P * W,
        "proj": L * 2 * P * W * W,
        "swiglu": L * (2 * P * W * 2 * inter + 2 * P * inter * W),
        "aligner": 2 * M * r * r * W * d + 2 * M * d * d,
    }
    return {k: float(v) for k, v in parts.items()}


def random_vision_weights(vcfg, text_hidden: int, device: torch.device, seed: int = 0):
    """FP32 weights for every tensor of the vision layout, drawn on `device` with the scales of
    `random_v41_tensors` (RMSNorm weights 1 + N(0, 0.1), biases N(0, 0.1), projections N(0, 1/fan_in))."""
    from deepinfer_model.models.deepseek_v41.vision import VisionWeights, vision_layout

    g = torch.Generator(device).manual_seed(seed)
    values = {}
    for spec in vision_layout(vcfg, text_hidden):
        t = torch.randn(*spec.shape, generator=g, device=device)
        if spec.name.endswith("norm.weight") or spec.name.endswith(("norm1.weight", "norm2.weight")):
            t = 1.0 + 0.1 * t
        elif spec.name.endswith(".bias"):
            t = 0.1 * t
        else:
            t = t * spec.shape[-1] ** -0.5
        values[spec.name] = t
    return VisionWeights.from_tensors(vcfg, values.__getitem__)


def _timer(device: torch.device):
    """fn -> ms of one call: CUDA events on a GPU (the device's time from the first launch to the last
    kernel's end), the host clock on the CPU."""
    if device.type == "cuda":

        def cuda_ms(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return cuda_ms

    def cpu_ms(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cpu_ms


def median_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    timer = _timer(device)
    for _ in range(warmup):
        timer(fn)
    return statistics.median(timer(fn) for _ in range(repeats))


def attention_kernel(fn, device: torch.device) -> str | None:
    """The device kernel named like an attention kernel with the most time in one profiled call of `fn`
    ("none" where no kernel is: the einsum path runs GEMMs and a softmax); None on the CPU."""
    if device.type != "cuda":
        return None
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        best, best_us = "none", 0.0
        for evt in prof.key_averages():
            us = getattr(evt, "device_time_total", None)
            us = getattr(evt, "cuda_time_total", 0.0) if us is None else us
            if us > best_us and _ATTENTION_KERNEL.search(evt.key) and not evt.key.startswith("aten::"):
                best, best_us = evt.key[:160], us
        return best
    except Exception as e:  # the profiler is evidence, not the measurement: its failure is recorded
        return f"profiler failed: {type(e).__name__}: {e}"[:160]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def measured_gemm_tflops(device: torch.device) -> float:
    """A square GEMM's rate in BF16 on a GPU (8192^3), FP32 on the CPU (1024^3): best of 5 after a warm-up."""
    n, dt = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
    timer = _timer(device)
    timer(lambda: torch.mm(a, b))
    return 2 * n**3 / min(timer(lambda: torch.mm(a, b)) for _ in range(5)) / 1e9


def peak_tflops(device: torch.device, measured: float) -> tuple[float, str]:
    """The dense BF16 peak of the device (datasheet), or the measured GEMM rate where the table has none."""
    from deepinfer_cluster import lookup_peak_rates

    row = lookup_peak_rates(device_name(device)) if device.type == "cuda" else None
    return (row.bf16_tflops, f"datasheet {row.model}") if row else (measured, "measured GEMM")


def _variant(text: str) -> tuple[str, str]:
    attention, _, dtype = text.partition(":")
    if attention not in ("fused", "reference") or dtype not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"a variant is ATTENTION:DTYPE with ATTENTION in fused, reference and DTYPE in "
            f"{', '.join(DTYPES)}; got {text!r}"
        )
    return attention, dtype


def _cells(text: str) -> int:
    c = int(text)
    side = math.isqrt(c)
    if c < 1 or side * side != c:
        raise argparse.ArgumentTypeError(f"--cells must be square numbers >= 1 (a square grid), got {c}")
    return c


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda[:N] or cpu (default cuda)")
    ap.add_argument("--cells", type=_cells, nargs="+", default=[256, 576, 1024],
                    help="tokens (merged cells) per image, square numbers (default 256 576 1024)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=32, help="encoder blocks (default 32, V4.1-Flash's)")
    ap.add_argument("--text-hidden", type=int, default=4096,
                    help="the aligner's output width d (default 4096; with --model, the model's)")  # fmt: skip
    ap.add_argument("--variants", type=_variant, nargs="+", default=[_variant(v) for v in DEFAULT_VARIANTS],
                    help=f"ATTENTION:DTYPE pairs (default {' '.join(DEFAULT_VARIANTS)}; the baseline "
                    f"{BASELINE} is added when missing)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per configuration (default 2)")
    ap.add_argument(
        "--repeats", type=int, default=7, help="timed calls per configuration, median (default 7)"
    )
    ap.add_argument(
        "--model", type=Path, default=None, help="a V4.1 checkpoint directory: time its prefill too"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS.relative_to(ROOT)})"
    )
    args = ap.parse_args(argv)
    for name in ("layers", "text_hidden", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.device.type not in ("cuda", "cpu"):
        ap.error(f"--device must be cuda[:N] or cpu, got {args.device}")
    base = _variant(BASELINE)
    args.variants = list(dict.fromkeys(args.variants + [base]))
    json_path = args.json.resolve()
    if json_path.is_relative_to(COMMITTED.resolve()) and json_path.exists():
        ap.error(f"--json {args.json}: refusing to overwrite committed results; give a new path")
    return args


def bench_encoder(args, vcfg, text_hidden: int, peak: float, gemm: float) -> list[dict]:
    from deepinfer_model.models.deepseek_v41.vision import VisionTower, image_positions

    dev = args.device
    tower = VisionTower(vcfg, random_vision_weights(vcfg, text_hidden, dev, args.seed))
    cuda = dev.type == "cuda"
    records = []
    for cells in args.cells:
        n = math.isqrt(cells)  # merged cells per side
        side = n * vcfg.downsample_ratio  # patches per side
        g = torch.Generator(dev).manual_seed(args.seed + cells)
        patches = torch.rand(side * side, vcfg.patch_dim, generator=g, device=dev) * 2 - 1
        flops = encoder_flops(vcfg, cells, text_hidden)
        total = sum(flops.values())
        outs = {}
        for attention, dtype in args.variants:
            dt = DTYPES[dtype]
            tower.weights_for(dt)  # (the one-time cast stays out of the timings and the memory peak)

            def call(dt=dt, attention=attention, patches=patches, side=side):
                with torch.no_grad():
                    return tower.embed_image(patches, side, side, dtype=dt, attention=attention)

            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                before = torch.cuda.memory_allocated(dev)
            out = call()
            peak_mem = (torch.cuda.max_memory_allocated(dev) - before) / 2**30 if cuda else None
            ms = median_ms(call, dev, args.warmup, args.repeats)
            kernel = attention_kernel(call, dev)
            outs[(attention, dtype)] = out.double().cpu()
            tflops = total / ms / 1e9
            records.append({
                "section": "encoder", "device": device_name(dev), "cells": cells, "grid": f"{n}x{n}",
                "patches": side * side, "lm_positions": image_positions(n, n), "layers": vcfg.num_hidden_layers,
                "width": vcfg.hidden_size, "heads": vcfg.num_attention_heads, "text_hidden": text_hidden,
                "attention": attention, "dtype": dtype, "ms_per_image": ms, "images_per_s": 1e3 / ms,
                "gflop_per_image": total / 1e9, "attention_gflop_per_image": flops["attention"] / 1e9,
                "achieved_tflops": tflops, "mfu_pct": 100 * tflops / peak, "peak_bf16_tflops": peak,
                "pct_of_measured_gemm": 100 * tflops / gemm, "measured_gemm_tflops": gemm,
                "peak_extra_mem_gib": peak_mem, "attention_kernel": kernel, "finite": bool(torch.isfinite(out).all()),
                "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
                "warmup": args.warmup, "repeats": args.repeats,
            })  # fmt: skip
            del out
        base = outs[_variant(BASELINE)]
        base_ms = next(r["ms_per_image"] for r in records[-len(args.variants) :] if r["attention"] == "reference"
                       and r["dtype"] == "float32")  # fmt: skip
        for r in records[-len(args.variants) :]:
            got = outs[(r["attention"], r["dtype"])]
            r["rel_err_vs_reference_fp32"] = float((got - base).norm() / base.norm())
            r["speedup_vs_reference_fp32"] = base_ms / r["ms_per_image"]
    return records


def bench_lm_prefill(args, model, model_name: str, enc_records: list[dict], peak: float) -> list[dict]:
    """The language model's prefill of each image size's positions, one fresh chunk at a time."""
    import numpy as np
    from deepinfer.bench.roofline import model_costs
    from deepinfer_model import numerics
    from deepinfer_model.models.deepseek_v41.vision import image_positions
    from deepinfer_model.runner import StepBatch
    from deepinfer_model.runtime import PagedRunner

    costs = model_costs(model)
    block = 16
    records = []
    for cells in args.cells:
        tokens = image_positions(math.isqrt(cells), math.isqrt(cells))
        per_seq = -(-tokens // block)
        runner = PagedRunner(model, num_blocks=per_seq, block_size=block)
        table = [np.arange(per_seq, dtype=np.int32)]
        # ordinary text ids: clear of the special tokens at the start of a real vocabulary
        hi = min(int(model.config.vocab_size), 90_000)
        ids = np.random.default_rng(args.seed).integers(min(1000, hi // 2), hi, (1, tokens))

        def step(runner=runner, table=table, ids=ids):
            torch.argmax(runner.execute(StepBatch.lockstep(table, 0, ids)), -1).tolist()

        ms = median_ms(step, args.device, args.warmup, args.repeats)
        runner.close()
        flops = costs.prefill_flops(tokens)
        enc = {r["attention"] + ":" + r["dtype"]: r for r in enc_records if r["cells"] == cells}
        default = enc.get("fused:bfloat16" if args.device.type == "cuda" else "reference:float32")
        rec = {
            "section": "lm_prefill", "device": device_name(args.device), "model": model_name, "cells": cells,
            "lm_tokens": tokens, "numerics": numerics.mode(), "ms_per_prefill": ms, "tokens_per_s": tokens / ms * 1e3,
            "gflop_per_prefill": flops / 1e9, "achieved_tflops": flops / ms / 1e9,
            "mfu_pct": 100 * flops / ms / 1e9 / peak, "peak_bf16_tflops": peak,
            "warmup": args.warmup, "repeats": args.repeats,
        }  # fmt: skip
        if default is not None:
            rec["encoder_variant"] = f"{default['attention']}:{default['dtype']}"
            rec["encoder_ms_per_image"] = default["ms_per_image"]
            rec["encoder_over_prefill_time"] = default["ms_per_image"] / ms
        records.append(rec)
    return records


def _table(title: str, records: list[dict], cols: tuple[str, ...]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # a plain table where rich is not installed
        print(title)
        print("  ".join(cols))
        for r in records:
            print("  ".join(_fmt(r.get(c)) for c in cols))
        return
    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="right")
    for r in records:
        t.add_row(*(_fmt(r.get(c)) for c in cols))
    Console(width=250).print(t)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    model, model_name, text_hidden = None, None, args.text_hidden
    if args.model is not None:
        from deepinfer_model import load_model

        model = load_model(args.model, torch.bfloat16, device=args.device)
        model_name, text_hidden = args.model.name, int(model.config.hidden_size)
    vcfg = dataclasses.replace(flash_vision_config(), num_hidden_layers=args.layers)
    gemm = measured_gemm_tflops(args.device)
    peak, source = peak_tflops(args.device, gemm)
    records = bench_encoder(args, vcfg, text_hidden, peak, gemm)
    for r in records:
        r["peak_source"] = source
    enc_cols = ("cells", "patches", "attention", "dtype", "ms_per_image", "images_per_s", "gflop_per_image",
                "achieved_tflops", "mfu_pct", "pct_of_measured_gemm", "speedup_vs_reference_fp32",
                "rel_err_vs_reference_fp32", "peak_extra_mem_gib")  # fmt: skip
    _table(f"V4.1-Flash vision encoder ({vcfg.num_hidden_layers} layers) on {device_name(args.device)}; "
           f"peak {peak:.4g} TFLOP/s ({source}), GEMM {gemm:.4g} TFLOP/s measured; median of {args.repeats}",
           records, enc_cols)  # fmt: skip
    for r in records:
        if r["attention_kernel"] is not None:
            print(
                f"{r['cells']:>5} cells {r['attention']}:{r['dtype']}: attention kernel {r['attention_kernel']}"
            )
    if model is not None:
        lm = bench_lm_prefill(args, model, model_name, records, peak)
        _table(f"{model_name} prefill of one image's positions (BF16 activations)", lm,
               ("cells", "lm_tokens", "numerics", "ms_per_prefill", "tokens_per_s", "gflop_per_prefill",
                "mfu_pct", "encoder_variant", "encoder_ms_per_image", "encoder_over_prefill_time"))  # fmt: skip
        records += lm
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {args.json}")
    return records


if __name__ == "__main__":
    main()
