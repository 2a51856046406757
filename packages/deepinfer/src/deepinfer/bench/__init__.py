"""Benchmarks of the engine.

* `deepinfer bench prefill|decode|sweep` (`harness.main`): Pareto sweeps with the reference's methodology
  (separate prefill / decode sections, warm-up, measurement windows, intervals flagged by a MoE
  load-balance flush dropped, full-acceptance and measured decode accounting, roofline, profiler
  attached after measuring).
* `deepinfer bench [throughput]` (`add_bench_args` / `run_bench`): offline throughput, sync vs async loop.

The names below are imported from their modules on first use: `deepinfer bench --help` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# module -> the public names it defines
_MODULES: dict[str, tuple[str, ...]] = {
    "accounting": (
        "decode_full_acceptance_per_gpu",
        "decode_full_acceptance_per_user",
        "decode_measured_per_gpu",
        "decode_measured_per_user",
        "prefill_tok_per_s_per_gpu",
    ),
    "intervals": ("FlagCounter", "Interval", "WindowStats", "summarize"),
    "pareto": ("pareto_front",),
    "roofline": (
        "Ceilings",
        "ModelCosts",
        "decode_roof",
        "machine_ceilings",
        "measure_ceilings",
        "model_costs",
        "prefill_roof",
    ),
    "throughput": ("add_bench_args", "run_bench"),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer.bench' has no attribute {name!r}")
    loaded = importlib.import_module(f"deepinfer.bench.{module}")
    for public in _MODULES[module]:
        globals()[public] = getattr(loaded, public)
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
