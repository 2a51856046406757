"""Benchmarks of the engine.

* `deepinfer bench prefill|decode|sweep` (`harness.main`): Pareto sweeps with the reference's methodology
  (separate prefill / decode sections, warm-up, measurement windows, intervals flagged by a MoE
  load-balance flush dropped, full-acceptance and measured decode accounting, roofline, profiler
  attached after measuring).
* `deepinfer bench [throughput]` (`add_bench_args` / `run_bench`): offline throughput, sync vs async loop.
"""

from .accounting import (
    decode_full_acceptance_per_gpu,
    decode_full_acceptance_per_user,
    decode_measured_per_gpu,
    decode_measured_per_user,
    prefill_tok_per_s_per_gpu,
)
from .intervals import FlagCounter, Interval, WindowStats, summarize
from .pareto import pareto_front
from .roofline import (
    Ceilings,
    ModelCosts,
    decode_roof,
    machine_ceilings,
    measure_ceilings,
    model_costs,
    prefill_roof,
)
from .throughput import add_bench_args, run_bench

__all__ = [
    "Ceilings",
    "FlagCounter",
    "Interval",
    "ModelCosts",
    "WindowStats",
    "add_bench_args",
    "decode_full_acceptance_per_gpu",
    "decode_full_acceptance_per_user",
    "decode_measured_per_gpu",
    "decode_measured_per_user",
    "decode_roof",
    "machine_ceilings",
    "measure_ceilings",
    "model_costs",
    "pareto_front",
    "prefill_roof",
    "prefill_tok_per_s_per_gpu",
    "run_bench",
    "summarize",
]
