"""Peak rates per device model for roofline reports: dense bf16 / fp8 TFLOP/s and HBM TB/s.

Numbers are the vendors' public datasheet figures for dense math: the datasheets headline the
2:4-sparse figures, and dense is half of those (e.g. H100 SXM bf16 1979 sparse -> 989.5 dense). They are ceilings, not expectations: a measured rate
(e.g. a long bf16 GEMM, a device-to-device copy) should replace them through `with_measured`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PeakRates:
    model: str  # canonical model name of the table row
    bf16_tflops: float
    fp8_tflops: float | None  # None: no fp8 tensor cores (A100)
    hbm_tbps: float
    memory_gb: float
    source: str = "datasheet"

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity (bf16 FLOP per HBM byte) below which a kernel is memory-bound."""
        return self.bf16_tflops / self.hbm_tbps

    def with_measured(self, **measured: float) -> PeakRates:
        """Replace some rates by measured ones (fields: bf16_tflops, fp8_tflops, hbm_tbps)."""
        allowed = {"bf16_tflops", "fp8_tflops", "hbm_tbps"}
        unknown = set(measured) - allowed
        if unknown:
            raise ValueError(f"with_measured: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}")
        for key, value in measured.items():
            if not value > 0:
                raise ValueError(f"with_measured: {key}={value} must be > 0")
        return replace(self, **measured, source="measured")


# (pattern on the normalised device name, row). Order matters: specific names before general ones
# ("GB200" before "B200", "H100 NVL" / "H100 PCIe" before plain "H100", which is the SXM part).
_TABLE: list[tuple[str, PeakRates]] = [
    (r"GB200", PeakRates("GB200", 2500.0, 5000.0, 8.0, 186.0)),
    (r"B200", PeakRates("B200", 2250.0, 4500.0, 8.0, 180.0)),
    (r"H200 NVL", PeakRates("H200 NVL", 835.5, 1670.5, 4.8, 141.0)),
    (r"H200", PeakRates("H200 SXM", 989.5, 1979.0, 4.8, 141.0)),
    (r"H100 NVL", PeakRates("H100 NVL", 835.5, 1670.5, 3.9, 94.0)),
    (r"H100 PCIE", PeakRates("H100 PCIe", 756.5, 1513.0, 2.0, 80.0)),
    (r"H100", PeakRates("H100 SXM", 989.5, 1979.0, 3.35, 80.0)),
    (r"A100.*PCIE.*40GB|A100.*40GB.*PCIE", PeakRates("A100 PCIe 40GB", 312.0, None, 1.555, 40.0)),
    (r"A100.*PCIE", PeakRates("A100 PCIe 80GB", 312.0, None, 1.935, 80.0)),
    (r"A100.*40GB", PeakRates("A100 SXM 40GB", 312.0, None, 1.555, 40.0)),
    (r"A100", PeakRates("A100 SXM 80GB", 312.0, None, 2.039, 80.0)),
]


def _normalise(name: str) -> str:
    return re.sub(r"[\s_\-]+", " ", name.upper()).strip()


def lookup_peak_rates(device_name: str) -> PeakRates | None:
    """Table row for a device name as NVML / nvidia-smi report it ("NVIDIA H100 80GB HBM3"), or None."""
    key = _normalise(device_name)
    for pattern, rates in _TABLE:
        if re.search(pattern, key):
            return rates
    return None


def peak_rates(device_name: str, measured: dict[str, float] | None = None) -> PeakRates:
    """Peak rates of `device_name`, with measured values taking precedence.

    Unknown devices need all three rates measured (fp8 may be left out); otherwise ValueError.
    """
    row = lookup_peak_rates(device_name)
    measured = dict(measured or {})
    if row is None:
        if not {"bf16_tflops", "hbm_tbps"} <= set(measured):
            known = ", ".join(r.model for _, r in _TABLE)
            raise ValueError(
                f"device_name {device_name!r} is not in the peak-rate table ({known}); "
                "pass measured={'bf16_tflops': ..., 'hbm_tbps': ...}"
            )
        row = PeakRates(device_name, measured["bf16_tflops"], None, measured["hbm_tbps"], 0.0, "measured")
    return row.with_measured(**measured) if measured else row


def known_models() -> list[str]:
    return [r.model for _, r in _TABLE]
