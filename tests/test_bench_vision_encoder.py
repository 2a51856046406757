"""benchmarks/model/bench_vision_encoder.py: its FLOP formula against torch's own FLOP counter on the
encoder as it runs (both attentions), and a CPU smoke run at minimal size, with the language model's prefill
of the tiny checkpoint beside it: every record has the keys the GPU report is read by."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "model"))
import bench_vision_encoder as bench  # noqa: E402

ENCODER_KEYS = {"section", "device", "cells", "grid", "patches", "lm_positions", "layers", "attention", "dtype",
                "ms_per_image", "images_per_s", "gflop_per_image", "achieved_tflops", "mfu_pct", "peak_bf16_tflops",
                "peak_source", "pct_of_measured_gemm", "speedup_vs_reference_fp32", "rel_err_vs_reference_fp32",
                "peak_extra_mem_gib", "finite"}  # fmt: skip
PREFILL_KEYS = {"section", "model", "cells", "lm_tokens", "ms_per_prefill", "tokens_per_s", "gflop_per_prefill",
                "mfu_pct", "encoder_ms_per_image", "encoder_over_prefill_time"}  # fmt: skip


@pytest.mark.parametrize("attention", ["reference", "fused"])
def test_flop_formula_matches_torch_flop_counter(attention):
    from deepinfer_model.models.deepseek_v41.vision import VisionTower

    vcfg = dataclasses.replace(
        bench.flash_vision_config(2), hidden_size=64, num_attention_heads=4, intermediate_size=96
    )
    tower = VisionTower(vcfg, bench.random_vision_weights(vcfg, 48, torch.device("cpu")))
    for cells in (4, 9):
        side = math.isqrt(cells) * vcfg.downsample_ratio
        patches = torch.rand(side * side, vcfg.patch_dim)
        with FlopCounterMode(display=False) as counter:
            tower.embed_image(patches, side, side, attention=attention)
        assert sum(bench.encoder_flops(vcfg, cells, 48).values()) == counter.get_total_flops()


def test_flash_flops_at_1024_cells():
    """The full encoder at 1,024 tokens (9,216 patches), by hand: per layer QKV 58.0 + attention 347.9 +
    projection 19.3 + SwiGLU 159.5 = 584.7 GFLOP, x 32 layers = 18,709 GFLOP; patch embedding 11.1, aligner
    77.3 + 34.4: 18.83 TFLOP per image, the attention 59% of it."""
    f = bench.encoder_flops(bench.flash_vision_config(), 1024, 4096)
    assert f["attention"] == 32 * 4 * 9216**2 * 1024
    assert sum(f.values()) == pytest.approx(18.83e12, rel=1e-3)
    assert f["attention"] / sum(f.values()) == pytest.approx(0.59, abs=0.01)


def test_cpu_smoke_run_with_prefill(tmp_path):
    from deepinfer_model.models.deepseek_v41 import make_v41_checkpoint

    ckpt = make_v41_checkpoint(tmp_path / "tiny")
    out = tmp_path / "vision.json"
    records = bench.main(["--device", "cpu", "--layers", "1", "--cells", "4", "--warmup", "0", "--repeats", "1",
                          "--model", str(ckpt), "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == records
    enc = {(r["attention"], r["dtype"]): r for r in records if r["section"] == "encoder"}
    assert set(enc) == {("fused", "bfloat16"), ("fused", "float32"), ("reference", "bfloat16"),
                        ("reference", "float32")}  # fmt: skip
    for r in enc.values():
        assert ENCODER_KEYS <= set(r), ENCODER_KEYS - set(r)
        assert (r["cells"], r["patches"], r["grid"], r["lm_positions"]) == (4, 36, "2x2", 8)
        assert (
            r["finite"]
            and r["ms_per_image"] > 0
            and r["images_per_s"] == pytest.approx(1e3 / r["ms_per_image"])
        )
    assert enc[("reference", "float32")]["speedup_vs_reference_fp32"] == 1.0
    assert enc[("reference", "float32")]["rel_err_vs_reference_fp32"] == 0.0
    assert enc[("fused", "float32")]["rel_err_vs_reference_fp32"] < 1e-5
    assert enc[("fused", "bfloat16")]["rel_err_vs_reference_fp32"] < 8 * 2**-8
    (pre,) = [r for r in records if r["section"] == "lm_prefill"]
    assert PREFILL_KEYS <= set(pre), PREFILL_KEYS - set(pre)
    assert pre["lm_tokens"] == 8 and pre["encoder_variant"] == "reference:float32"


def test_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--cells", "10"])  # not a square grid
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--variants", "flash:bfloat16"])
    committed = next(bench.COMMITTED.glob("*.json"))
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--json", str(committed)])
    args = bench.parse_args(["--device", "cpu", "--variants", "fused:bfloat16"])
    assert args.variants == [("fused", "bfloat16"), ("reference", "float32")]  # the baseline is added
