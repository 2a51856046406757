"""Machine ceilings and the model's per-token costs, combined into roofline curves for the plots.

Ceilings start from `deepinfer_cluster.peak_rates` (datasheet table) and are overridden by a quick
in-run measurement on the engine's device (a large copy for memory bandwidth, a square matmul in
the compute dtype for the math rate): the CPU has no table row, and on a GPU the measured figure is
the one the engine can really reach.

Costs come from the model's weight tensors: matmul FLOPs per token = 2 × (dense matrix elements +
routed-expert matrix elements × top-k / experts); embedding-style lookups and the drafter are left out. Attention
over the context is not counted, so the roof is an upper bound. A decode step reads every dense
weight once plus the routed experts its tokens touch (expected fraction 1 - (1 - k/E)^tokens).
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    device: str
    tflops: float  # matmul rate in the compute dtype (the table's bf16 column)
    tbps: float  # memory bandwidth
    source: str  # "datasheet" or "measured"


def model_device(model) -> torch.device:
    """Where the model's weights live (the device its forward runs on)."""
    for t in _tensors(getattr(model, "weights", model)):
        return t.device
    return torch.device("cpu")


def _tensors(o, depth: int = 0):
    if depth > 10 or o is None:
        return
    if isinstance(o, torch.Tensor):
        yield o
    elif isinstance(o, list | tuple):
        for x in o:
            yield from _tensors(x, depth + 1)
    elif isinstance(o, dict):
        for x in o.values():
            yield from _tensors(x, depth + 1)
    elif hasattr(o, "__dict__") and type(o).__module__.startswith("deepinfer"):
        for x in vars(o).values():
            yield from _tensors(x, depth + 1)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def _best_time(fn, repeats: int, sync) -> float:
    fn()
    sync()  # warm-up (allocation, kernel selection)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Quick copy-bandwidth and matmul-rate measurement (about a second on a CPU)."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    nbytes = (1 << 30) if cuda else (64 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), 5, sync)
    n = 8192 if cuda else 768
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm_s = _best_time(lambda: torch.mm(a, b), 5 if cuda else 3, sync)
    return {"bf16_tflops": 2 * n**3 / mm_s / 1e12, "hbm_tbps": 2 * nbytes / copy_s / 1e12}


def machine_ceilings(device: torch.device, dtype: torch.dtype, measure: bool = True) -> Ceilings:
    from deepinfer_cluster import peak_rates

    name = device_name(device)
    measured = measure_ceilings(device, dtype) if measure else None
    rates = peak_rates(name, measured)  # unknown devices (CPUs) need the measurement
    return Ceilings(name, rates.bf16_tflops, rates.hbm_tbps, rates.source)


@dataclass(frozen=True)
class ModelCosts:
    dense_params: int  # matrix elements every token multiplies through (LM head included)
    head_params: int  # of which the LM head: a prefill chunk needs it for its last position only
    routed_params: int  # matrix elements of all routed experts
    dense_bytes: int  # every weight byte except routed experts and lookup tables
    routed_bytes: int
    top_k: int
    num_experts: int

    @property
    def flops_per_token(self) -> float:
        """Decode: every token goes through the whole model, LM head included."""
        routed = self.routed_params * self.top_k / self.num_experts if self.num_experts else 0
        return 2.0 * (self.dense_params + routed)

    def prefill_flops(self, chunk: int) -> float:
        """A prefill chunk: every token through the body, the LM head only at the last position."""
        return chunk * (self.flops_per_token - 2.0 * self.head_params) + 2.0 * self.head_params

    def step_bytes(self, tokens: int) -> float:
        """Weight bytes one forward over `tokens` tokens reads (expected distinct experts touched)."""
        if not self.num_experts:
            return float(self.dense_bytes)
        touched = 1.0 - (1.0 - self.top_k / self.num_experts) ** max(tokens, 0)
        return self.dense_bytes + self.routed_bytes * touched


_LOOKUPS = (".embed", "engram.table")
# The MTP / DSpark drafter runs only with nextn > 0; the roof is the target model's (an upper bound then).
_DRAFTER = "weights.drafter"


def model_costs(model) -> ModelCosts:
    """Walk the model's weight tensors (`model.weights`) and sort them into dense / routed / lookups."""
    cfg = model.config
    seen: set[int] = set()
    totals = {"dense_params": 0, "head_params": 0, "routed_params": 0, "dense_bytes": 0, "routed_bytes": 0}

    def walk(o, path: str, depth: int) -> None:
        if depth > 10 or o is None:
            return
        if isinstance(o, torch.Tensor):
            if o.data_ptr() in seen or not o.is_floating_point() and o.dtype != torch.uint8:
                return
            seen.add(o.data_ptr())
            if any(k in path for k in _LOOKUPS) or path.startswith(_DRAFTER):
                return
            nbytes = o.numel() * o.element_size()
            if ".experts." in path and "shared" not in path:
                totals["routed_params"] += o.numel() if o.dim() >= 2 else 0
                totals["routed_bytes"] += nbytes
            else:
                totals["dense_params"] += o.numel() if o.dim() >= 2 else 0
                if path == "weights.head":
                    totals["head_params"] += o.numel()
                totals["dense_bytes"] += nbytes
        elif isinstance(o, list | tuple):
            for i, x in enumerate(o):
                walk(x, f"{path}[{i}]", depth + 1)
        elif isinstance(o, dict):
            for k, x in o.items():
                walk(x, f"{path}.{k}", depth + 1)
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("deepinfer"):
            for k, x in vars(o).items():
                walk(x, f"{path}.{k}", depth + 1)

    walk(getattr(model, "weights", model), "weights", 0)
    return ModelCosts(
        **totals,
        top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0),
        num_experts=int(getattr(cfg, "n_routed_experts", 0) or 0),
    )


def prefill_roof(costs: ModelCosts, ceil: Ceilings, chunk: int) -> tuple[float, float]:
    """(chunk latency s, tokens/s/GPU) of an ideal machine: max(compute time, weight-read time)."""
    t = max(costs.prefill_flops(chunk) / (ceil.tflops * 1e12), costs.step_bytes(chunk) / (ceil.tbps * 1e12))
    return t, chunk / t


def decode_roof(costs: ModelCosts, ceil: Ceilings, batch: int, nextn: int = 0) -> tuple[float, float]:
    """(tokens/s/user, tokens/s/GPU) of an ideal machine at `batch` (full acceptance of nextn drafts)."""
    tokens = batch * (1 + nextn)
    t = max(
        tokens * costs.flops_per_token / (ceil.tflops * 1e12), costs.step_bytes(tokens) / (ceil.tbps * 1e12)
    )
    return (1 + nextn) / t, tokens / t
