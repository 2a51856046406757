"""Every DEEPINFER_* environment variable the engine reads, typed and documented in one place.

Values are read when accessed (`envs.DEEPINFER_HF_MODEL_DIR`), so tests and callers may change the
environment at any time. Booleans follow the reference: unset, "", "0", "false", "False" are false.
Names that start with DEEPINFER_ but are not listed here trigger one warning (`warn_unknown`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _bool(v: str) -> bool:
    return v not in ("", "0", "false", "False")


def _compile_backend(v: str) -> str | None:
    """none / "" -> None (the step as written), else a torch.compile backend of `runtime.compiled`."""
    from deepinfer_model.runtime.compiled import BACKENDS

    if v in ("", "0", "none"):
        return None
    if v not in BACKENDS:
        raise ValueError(
            f"DEEPINFER_CUDAGRAPH_COMPILE must be none or one of {', '.join(BACKENDS)}, got {v!r}"
        )
    return v


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    used_here: bool = True  # False: recognised reference knob for a feature this engine lacks


_VARS = [
    EnvVar("DEEPINFER_HF_MODEL_DIR", str, None, "checkpoint directory used when no model is given"),
    EnvVar(
        "DEEPINFER_CACHE_DIR",
        str,
        None,
        "where the generated deepinfer-tiny checkpoint lives (default: user cache dir)",
    ),
    EnvVar(
        "DEEPINFER_ZERO_OVERHEAD_SCHEDULING",
        _bool,
        None,
        "async (zero-overhead) scheduling; unset: EngineArgs.async_scheduling decides (on by default)",
    ),
    EnvVar(
        "DEEPINFER_ASYNC_DEVICE_INPUTS",
        _bool,
        True,
        "async loop: a step's input ids that are the previous step's tokens are read on the device, so "
        "the step is launched before those tokens reach the host; 0: filled on the host after it",
    ),
    EnvVar("DEEPINFER_ACCELERATOR", str, "cpu", "kernel backend: cpu (reference) or nvidia"),
    EnvVar(
        "DEEPINFER_TILELANG",
        str,
        "1",
        "NVIDIA backend: 1 the TileLang kernels verified on an H200, all every TileLang kernel, 0 none (torch)",
    ),
    EnvVar(
        "DEEPINFER_COMPILE_TRACED_OPS",
        str,
        "",
        "NVIDIA backend: ops an inductor-compiled decode step traces in their torch versions instead of "
        "calling the kernel (comma list of rms_norm, apply_rope, hc_read, hc_write; empty: none)",
    ),
    EnvVar(
        "DEEPINFER_COMPILE_CUSTOM_OPS",
        str,
        "1",
        "a compiled decode step records the accelerator ops (norms, RoPE, mHC, index scores, experts, top-k) as "
        "torch custom ops, one graph without breaks; 0: each call is a graph break (the earlier behaviour)",
    ),
    EnvVar(
        "DEEPINFER_DEEP_GEMM",
        str,
        "1",
        "NVIDIA backend: 0 keeps DeepGEMM out (FP8 linears / experts dequantise to BF16 GEMMs)",
    ),
    EnvVar(
        "DEEPINFER_TRITON",
        str,
        "1",
        "NVIDIA backend: 0 keeps the Triton kernels out: batch-invariant mode's row / tile GEMMs (reference "
        "tiles serve), the indexer's fused scores (torch path), the mHC mixes and the few-pair expert MLP",
    ),
    EnvVar(
        "DEEPINFER_TRITON_MOE_MAX_PAIRS",
        int,
        1024,
        "NVIDIA backend, native mode: routed-expert calls of at most this many (token, slot) pairs (decode) run "
        "the Triton expert kernels, larger ones the grouped GEMMs; 0: always the grouped GEMMs",
    ),
    EnvVar(
        "DEEPINFER_FLASH_MLA",
        str,
        "1",
        "NVIDIA backend: 0 keeps FlashMLA's sparse prefill out (native prefill attention takes the torch band path)",
    ),
    EnvVar(
        "DEEPINFER_DEVICE",
        str,
        "auto",
        "default of EngineArgs.device: auto (cuda if torch.cuda.is_available() else cpu), cpu, cuda or cuda:N",
    ),
    EnvVar(
        "DEEPINFER_DECODE_TOKEN_BLACKLIST",
        str,
        "",
        "token ids never sampled, syntax a..b,c (inclusive ranges)",
    ),
    EnvVar("DEEPINFER_LOGGING_INTERVAL_STEP", int, 100, "steps between stats log lines (<= 0 disables)"),
    EnvVar("DEEPINFER_GC_INTERVAL_STEP", int, 1000, "Python GC period in engine steps (GC is otherwise off)"),
    EnvVar(
        "DEEPINFER_BATCH_INVARIANT",
        _bool,
        False,
        "batch-invariant numerics: fixed-tile GEMMs so a row never depends on its batch (CPU); NVIDIA kernels not yet",
    ),
    EnvVar(
        "DEEPINFER_NUMERICS",
        str,
        "exact",
        "model numerics (read by deepinfer_model.numerics): exact (FP64 carrier) or native (FP32 carrier, "
        "activation-dtype GEMMs)",
    ),
    EnvVar(
        "DEEPINFER_FP8_EXPERTS",
        _bool,
        False,
        "1: MXFP4 routed experts converted at load to 128x128-block FP8 and run by the grouped_expert_mlp op "
        "with its FP8 activation casts, on CPU and GPU (read by deepinfer_model.quant_sm90); not with EP",
    ),
    EnvVar(
        "DEEPINFER_USE_NEXTN_DECODE",
        int,
        5,
        "draft tokens per decode step (0 = no speculative decoding); unset, the built-in random-weight "
        "deepinfer-tiny decodes without drafts (its drafter cannot be accepted)",
        False,
    ),
    EnvVar("DEEPINFER_ENABLE_MTP_VARLEN", _bool, False, "confidence-scheduled verification length", False),
    EnvVar(
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
        str,
        "off",
        "YoCo prefill truncation: off / mask / compact (V4.1 models with a YoCo split; compact + KEEP 140 is "
        "the reference's recommended V4.1 setting)",
    ),
    EnvVar(
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
        int,
        0,
        "prompt tokens the YoCo consumer layers replay; must be >= sliding_window + max backtracking",
    ),
    EnvVar(
        "DEEPINFER_MAX_BACKTRACKING_TOKENS",
        int,
        0,
        "max backtracking B = max(value, drafts + 1): the YoCo check KEEP >= W + B uses it",
    ),
    EnvVar(
        "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", int, 0, "minimum number of redundant experts (EPLB)", False
    ),
    EnvVar("DEEPINFER_SAMPLER_FORCE_TOPK", int, 0, "sample only among the top-K logits", False),
    EnvVar("DEEPINFER_COMPUTE_SUM_SMALLER_PROBS", _bool, False, "extra sampler statistic", False),
    EnvVar("DEEPINFER_XGRAMMAR_TIMEOUT", float, 20.0, "grammar compile timeout (s)", False),
    EnvVar(
        "DEEPINFER_EP_BACKEND",
        str,
        "auto",
        "MoE dispatch / combine under expert parallelism: auto (DeepEP on CUDA when deep_ep imports, else "
        "torch), torch (all-to-all; exact), deepep",
    ),
    EnvVar("DEEPINFER_ENFORCE_EAGER", _bool, False, "disable the decode CUDA graphs (CUDA devices)"),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_CAPTURE_ALL",
        _bool,
        False,
        "capture every decode CUDA-graph bucket at start (default: each bucket on its first use)",
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_BATCH_INVARIANT",
        _bool,
        True,
        "replay decode CUDA graphs in batch-invariant mode too (bitwise the eager step on the CPU, replay "
        "checked on an H200); 0: such steps run eagerly",
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_DRAFT",
        _bool,
        True,
        "greedy DSpark drafts through CUDA graphs too (bitwise the eager draft on the CPU, replay checked on "
        "an H200); 0: they run eagerly",
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_COMPILE",
        _compile_backend,
        None,
        "torch.compile backend for the graphed decode step before capture: inductor fuses the elementwise "
        "ops between the GEMMs (default mode only; batch-invariant steps run as written); none",
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL",
        int,
        8,
        "decode CUDA-graph buckets: powers of two below it, then its multiples up to max_num_seqs",
    ),
]
# Reference knobs of subsystems this engine does not have; recognised so they are not warned about.
_RECOGNISED_ONLY = """JIT_CACHE_DIR NCCL_NUM_SMS USERBUFFER_COMM_SMS GLOO_TIMEOUT REARRANGE_P2P_GROUPS
EXPERT_COUNT_WINDOW_SIZE EXPERT_REARRANGEMENT_STEP_INTERVAL REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE
MOE_LB_STAT_INTERVAL FORCE_IMBALANCE_RATIO FORCE_LOAD_BALANCE SHOW_EPLB_DETAIL PREFILL_MAX_SUM_SEQLEN_K
INDEX_ATTN_MEMORY_LIMIT DFLASH_CONFIDENCE_HEAD_TEMPERATURE ENGRAM_PAD_TOKEN
ENGRAM_FORCE_GPU_STORAGE DFLASH_ENFORCE_EAGER DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL
DECODE_PERF_CACHE_DIR DECODE_PERF_CACHE_TTL_SEC NUM_STATE_SLOTS_RATIO PREFILL_STORE_EXTRA_STATE
PREFILL_STORE_EXTRA_SIZE XGRAMMAR_DEBUG XGRAMMAR_DISABLE_CACHE XGRAMMAR_CACHE_LIMIT_BYTES SO_BUILDER_CPUS
PREFILL_ATTEMPT_INTERVAL PREFILL_ANY_ATTEMPT_INTERVAL NCCL_MEMORY_SAMPLE_INTERVAL_STEPS
RINGBUFFER_WARNING_INTERVAL DISABLE_SYNC_GUARD PROFILE_TORCH_CUDA_MEMORY ENABLE_MEMORY_TRACING
PROFILE_HTTP_ENABLE PROFILE_HTTP_PORT_BASE TORCH_PROFILER_DIR USE_MULTIMODAL_POOL MULTIMODAL_POOL_SIZE_GB
MULTI_MODAL_BUFFER_SIZE MULTI_MODAL_WORKER_TIMEOUT CPP_LOG_LEVEL FUSED_SAMPLE_STRESS_TEST
FUSED_SAMPLE_DETAIL_LOG""".split()

VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}
KNOWN_NAMES = frozenset(VARS) | {"DEEPINFER_" + n for n in _RECOGNISED_ONLY}


def get(name: str) -> Any:
    var = VARS[name]
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: {e}") from None


def is_set(name: str) -> bool:
    """Whether the user gave `name` (as opposed to its default applying)."""
    if name not in VARS:
        raise KeyError(f"{name} is not a DeepInfer environment variable")
    return name in os.environ


def __getattr__(name: str) -> Any:
    if name in VARS:
        return get(name)
    raise AttributeError(name)


def parse_token_ranges(spec: str) -> list[int]:
    """'a..b,c' -> [a, ..., b, c]; ranges inclusive and strictly increasing (reference syntax)."""
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("..")
        start, end = int(lo), int(hi or lo)
        if end < start or (ids and start <= ids[-1]):
            raise ValueError(f"DEEPINFER_DECODE_TOKEN_BLACKLIST must be strictly increasing, got {spec!r}")
        ids.extend(range(start, end + 1))
    return ids


_warned: set[str] = set()


def warn_unknown() -> list[str]:
    """Warn (once per name) about DEEPINFER_* variables nobody reads; returns the unknown names."""
    unknown = sorted(n for n in os.environ if n.startswith("DEEPINFER_") and n not in KNOWN_NAMES)
    for name in unknown:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"unknown environment variable {name} is ignored (typo?)", stacklevel=2)
    return unknown
