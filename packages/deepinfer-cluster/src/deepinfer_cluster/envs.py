"""Every `DEEPINFER_*` environment variable, declared once: name, kind, default, meaning, who reads it.

A leaf module (standard library only, no torch) that every package reads its settings through, so a
variable has one parser, one default and one error message wherever it is read. Values are parsed when
accessed (`envs.DEEPINFER_NUMERICS`, `envs.get(name)`), never cached: tests and benchmarks change the
environment while a process runs. A value the kind does not accept raises one ValueError that names the
variable, the allowed values and the value given. An empty value reads as unset (the default), except
for booleans, where "" is false as in the reference.

Booleans accept 1 / true / yes / on and 0 / false / no / off (any case); the reference treats every other
value as true, which turned typos such as "off" into "on". Flags (the kernel switches) take 0 or 1.

Besides the variables this engine reads, the reference's knobs for subsystems it does not have are
declared with `used=False`, so setting one is not mistaken for a typo (`warn_unknown`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "DEEPINFER_"


@dataclass(frozen=True)
class Kind:
    """How a raw value becomes a typed one: `convert` raises ValueError for a value outside `allowed`."""

    allowed: str
    convert: Callable[[str], Any]
    empty_is_default: bool = True


def _boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(raw)


BOOLEAN = Kind("1 / true / yes / on or 0 / false / no / off", _boolean, empty_is_default=False)


def _flag(raw: str) -> bool:
    value = raw.strip()
    if value not in ("0", "1"):
        raise ValueError(raw)
    return value == "1"


FLAG = Kind("0 or 1", _flag)
TEXT = Kind("a string", str)


def integer(lo: int | None = None, hi: int | None = None) -> Kind:
    """An integer, at least `lo` and at most `hi` where given."""
    if lo is not None and hi is not None:
        allowed = f"an integer in [{lo}, {hi}]"
    elif lo is not None:
        allowed = f"an integer >= {lo}"
    else:
        allowed = "an integer"

    def convert(raw: str) -> int:
        value = int(raw.strip())
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(raw)
        return value

    return Kind(allowed, convert)


def real(positive: bool = False) -> Kind:
    def convert(raw: str) -> float:
        value = float(raw.strip())
        if positive and not value > 0:
            raise ValueError(raw)
        return value

    return Kind("a number > 0" if positive else "a number", convert)


def choice(*values: str, none: tuple[str, ...] = ()) -> Kind:
    """One of `values` (any case, surrounding blanks ignored); the words in `none` read as None."""

    def convert(raw: str) -> str | None:
        value = raw.strip().lower()
        if value in none:
            return None
        if value not in values:
            raise ValueError(raw)
        return value

    allowed = f"one of {', '.join(values)}"
    return Kind(f"{none[-1]} or {allowed}" if none else allowed, convert, empty_is_default=not none)


def comma_list(*values: str) -> Kind:
    """A comma list of some of `values` (empty: none), as a tuple in the order given."""

    def convert(raw: str) -> tuple[str, ...]:
        items = tuple(n.strip() for n in raw.split(",") if n.strip())
        if set(items) - set(values):
            raise ValueError(raw)
        return items

    return Kind(f"a comma list of {', '.join(values)} (empty: none)", convert)


def _floats(raw: str) -> tuple[float, ...]:
    return tuple(float(v) for v in raw.split(","))


FLOATS = Kind("a number or a comma list of numbers", _floats)


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: Kind
    default: Any
    doc: str
    reader: str  # the module that reads it ("" for a reference knob nothing reads)
    used: bool = True  # False: a reference knob for a feature this engine does not have

    def parse(self, raw: str) -> Any:
        if self.kind.empty_is_default and not raw.strip():
            return self.default
        try:
            return self.kind.convert(raw)
        except ValueError:
            raise ValueError(f"{self.name} must be {self.kind.allowed}, got {raw!r}") from None

    @property
    def default_text(self) -> str:
        """The default as the README's table shows it."""
        value = self.default
        if value is None:
            return "unset"
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return ",".join(str(v) for v in value) or '""'
        if value == "":
            return '""'
        return str(value)


_ENGINE = "deepinfer.engine"
_NVIDIA = "deepinfer_model.backends.nvidia"
_EPLB = "deepinfer_parallel.eplb"
# Ops an inductor-compiled decode step may trace in their torch versions (DEEPINFER_COMPILE_TRACED_OPS).
TRACEABLE_OPS = ("rms_norm", "apply_rope", "hc_read", "hc_write")
# torch.compile backends of the graphed decode step (`deepinfer_model.runtime.compiled.BACKENDS`).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# How the data-parallel front routes requests to its ranks (`deepinfer.engine.dp_balance`).
DP_ROUTING_POLICIES = ("balanced", "static", "round_robin")
MAX_NEXTN = 32  # the drafter's block is at most 32 tokens (v41 spec §7)

_VARS = [
    # where the model comes from, and the device
    EnvVar(
        "DEEPINFER_HF_MODEL_DIR",
        TEXT,
        None,
        "checkpoint directory used when no model is given",
        "deepinfer.default_model",
    ),
    EnvVar(
        "DEEPINFER_CACHE_DIR",
        TEXT,
        None,
        "where the generated deepinfer-tiny checkpoint lives (unset: the user cache dir)",
        "deepinfer.default_model",
    ),
    EnvVar(
        "DEEPINFER_API_KEY",
        TEXT,
        None,
        "API key `deepinfer serve` requires (Authorization: Bearer KEY) when --api-key is not given (unset: none)",
        "deepinfer.serve",
    ),
    EnvVar(
        "DEEPINFER_DEBUG",
        BOOLEAN,
        False,
        "the deepinfer command prints an error's traceback (as --debug does) instead of one line",
        "deepinfer.cli",
    ),
    EnvVar(
        "DEEPINFER_DEVICE",
        TEXT,
        "auto",
        "default of EngineArgs.device: auto (cuda if torch sees one, else cpu), cpu, cuda or cuda:N",
        "deepinfer.engine_args",
    ),
    EnvVar(
        "DEEPINFER_ACCELERATOR",
        TEXT,
        None,
        "kernel backend of the op registry: cpu (reference) or nvidia "
        "(CUDA tensors); unset: the build's accelerator, cpu where no CUDA device is visible",
        "deepinfer_model.ops.registry",
    ),
    # the KV cache tier below the device prefix cache
    EnvVar(
        "DEEPINFER_KV_HOST_TIER_BYTES",
        integer(lo=0),
        0,
        "bytes of host memory that keep prefix-cache blocks the device cache evicts (0: no host tier); "
        "EngineArgs.kv_host_tier_bytes overrides",
        "deepinfer.engine_args",
    ),
    EnvVar(
        "DEEPINFER_KV_DISK_TIER_BYTES",
        integer(lo=0),
        0,
        "bytes of disk below the host tier, in DEEPINFER_KV_DISK_TIER_DIR (0: no disk tier); "
        "EngineArgs.kv_disk_tier_bytes overrides",
        "deepinfer.engine_args",
    ),
    EnvVar(
        "DEEPINFER_KV_DISK_TIER_DIR",
        TEXT,
        None,
        "directory of the disk KV tier (one subdirectory per model fingerprint; engines of one model may "
        "share it); EngineArgs.kv_disk_tier_dir overrides",
        "deepinfer.engine_args",
    ),
    # the engine loop
    EnvVar(
        "DEEPINFER_ZERO_OVERHEAD_SCHEDULING",
        BOOLEAN,
        None,
        "forces the async (1) or sync (0) loop; unset: EngineArgs.async_scheduling decides (on by default)",
        "deepinfer.engine_args",
    ),
    EnvVar(
        "DEEPINFER_ASYNC_DEVICE_INPUTS",
        BOOLEAN,
        True,
        "async loop: a step's input ids that are the previous "
        "step's tokens are read on the device, so the step is launched before they reach the host; 0: "
        "filled on the host",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_DECODE_TOKEN_BLACKLIST",
        TEXT,
        "",
        "token ids never sampled, a..b,c (inclusive ranges, strictly increasing)",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_LOGGING_INTERVAL_STEP",
        integer(),
        100,
        "steps between stats log lines (<= 0: none)",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_GC_INTERVAL_STEP",
        integer(),
        1000,
        "the reference's Python GC period in steps; GC stays on here",
        "",
        used=False,
    ),
    EnvVar(
        "DEEPINFER_XGRAMMAR_TIMEOUT",
        real(positive=True),
        20.0,
        "grammar compile deadline per request (s)",
        _ENGINE,
    ),
    # speculative decoding
    EnvVar(
        "DEEPINFER_USE_NEXTN_DECODE",
        integer(0, MAX_NEXTN),
        5,
        "draft tokens per decode step (0: no "
        "speculative decoding); unset, the random-weight deepinfer-tiny decodes without drafts",
        "deepinfer_spec.env",
    ),
    EnvVar(
        "DEEPINFER_ENABLE_MTP_VARLEN",
        BOOLEAN,
        True,
        "the draft policy: who drafts and how many drafts are verified, from the measured step time and "
        "acceptance (0: every sequence verifies all of its drafts); seeded sampled tokens do not depend on it "
        "while DEEPINFER_SPEC_SAMPLED_VERIFY is coupled",
        "deepinfer_spec.env",
    ),
    EnvVar(
        "DEEPINFER_SPEC_PROBE_BUDGET",
        real(positive=True),
        0.05,
        "the draft policy's exploration budget: the share of the plain decode time that probes (sequences "
        "that backed off drafting trying again) may add; a drafter that is never right costs about this much",
        "deepinfer_spec.env",
    ),
    EnvVar(
        "DEEPINFER_SPEC_SAMPLED_VERIFY",
        choice("coupled", "rejection"),
        "coupled",
        "how sampled requests verify drafts: coupled (each token is the plain sampler's draw at its "
        "position, a draft accepted iff it equals it: seeded outputs equal drafts-off ones whichever steps "
        "verify drafts) or rejection (rejection sampling: higher acceptance for a drafter near the target, "
        "tokens depend on which steps verify drafts)",
        "deepinfer_spec.env",
    ),
    EnvVar(
        "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE",
        FLOATS,
        (1.0,),
        "the drafter's confidence-head temperature: one number, or one per draft step; each floored at 1e-5",
        "deepinfer_model.models.deepseek_v41.drafter_heads",
    ),
    # YoCo prefill truncation
    EnvVar(
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
        choice("off", "mask", "compact"),
        "off",
        "YoCo prefill "
        "truncation of V4.1 models with a YoCo split (compact + KEEP 140 is the reference's V4.1 setting)",
        "deepinfer_model.models.deepseek_v41.yoco",
    ),
    EnvVar(
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
        integer(),
        0,
        "prompt tokens the YoCo consumer layers replay; "
        "> 0 and >= sliding window + max backtracking when truncating",
        "deepinfer_model.models.deepseek_v41.yoco",
    ),
    EnvVar(
        "DEEPINFER_MAX_BACKTRACKING_TOKENS",
        integer(0),
        0,
        "max backtracking B = max(value, drafts + 1), used by the YoCo check KEEP >= W + B",
        "deepinfer.engine.truncation",
    ),
    # model numerics
    EnvVar(
        "DEEPINFER_NUMERICS",
        choice("exact", "native"),
        "exact",
        "model numerics: exact (FP64 carrier, the "
        "CPU reference) or native (FP32 carrier, GEMMs in the activation dtype; not with "
        "DEEPINFER_BATCH_INVARIANT=1)",
        "deepinfer_model.numerics",
    ),
    EnvVar(
        "DEEPINFER_BATCH_INVARIANT",
        BOOLEAN,
        False,
        "batch-invariant GEMMs and tiled attention: a request's "
        "logits do not depend on its batch (CPU and CUDA)",
        "deepinfer_model.batch_invariant.switch",
    ),
    EnvVar(
        "DEEPINFER_FP8_EXPERTS",
        FLAG,
        False,
        "1: MXFP4 routed experts converted at load to 128x128-block "
        "FP8 and run by the grouped_expert_mlp op, on CPU and GPU; not with expert parallelism",
        "deepinfer_model.quant_sm90",
    ),
    EnvVar(
        "DEEPINFER_MULTI_MODAL_WORKER_TIMEOUT",
        integer(1),
        1800,
        "seconds the image workers may go without finishing an image before the images waiting fail their "
        "requests (the worker pool is replaced)",
        "deepinfer_model.models.deepseek_v41.vision.workers",
    ),
    EnvVar(
        "DEEPINFER_ENCODER_CACHE_TOKENS",
        integer(1),
        1 << 16,
        "image embedding rows (image tokens) the encoder cache keeps by image content hash; "
        "EngineArgs.encoder_cache_tokens overrides",
        "deepinfer.engine_args",
    ),
    EnvVar(
        "DEEPINFER_ENGRAM_PAD_TOKEN",
        integer(),
        2,
        "raw pad token id of Engram n-gram windows",
        "deepinfer_model.models.deepseek_v41.engram_vocab",
    ),
    # NVIDIA kernels: chosen when the op table is built (`deepinfer_model.ops.registry`)
    EnvVar(
        "DEEPINFER_TILELANG",
        choice("0", "1", "all"),
        "1",
        "NVIDIA backend: 1 the TileLang kernels verified "
        "on a GPU, all every TileLang kernel, 0 none (torch versions)",
        _NVIDIA,
    ),
    EnvVar(
        "DEEPINFER_DEEP_GEMM",
        FLAG,
        True,
        "NVIDIA backend: 0 keeps DeepGEMM out (FP8 linears / experts dequantise to BF16 GEMMs)",
        _NVIDIA,
    ),
    EnvVar(
        "DEEPINFER_TRITON",
        FLAG,
        True,
        "NVIDIA backend: 0 keeps the Triton kernels out (batch-invariant "
        "row / tile GEMMs, the indexer's scores and top-k, the mHC mixes, the expert MLP, Engram)",
        _NVIDIA,
    ),
    EnvVar(
        "DEEPINFER_TRITON_MOE_MAX_PAIRS",
        integer(0),
        1024,
        "NVIDIA backend, native mode: routed-expert calls "
        "of at most this many (token, slot) pairs run the Triton expert kernels, larger ones the grouped "
        "GEMMs (0: always the grouped GEMMs)",
        _NVIDIA,
    ),
    EnvVar(
        "DEEPINFER_FLASH_MLA",
        FLAG,
        True,
        "NVIDIA backend: 0 keeps FlashMLA's sparse prefill out (prefill attention takes the torch band path)",
        _NVIDIA,
    ),
    EnvVar(
        "DEEPINFER_COMPILE_TRACED_OPS",
        comma_list(*TRACEABLE_OPS),
        (),
        "NVIDIA backend: ops an "
        "inductor-compiled decode step traces in their torch versions instead of calling the kernel",
        _NVIDIA,
    ),
    EnvVar(
        "DEEPINFER_COMPILE_CUSTOM_OPS",
        FLAG,
        True,
        "a compiled decode step records the accelerator ops as "
        "torch custom ops, one graph without breaks; 0: each call is a graph break",
        "deepinfer_model.compile_boundary",
    ),
    # decode CUDA graphs
    EnvVar("DEEPINFER_ENFORCE_EAGER", BOOLEAN, False, "no decode CUDA graphs", _ENGINE),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL",
        integer(),
        8,
        "decode graph buckets: powers of two below it, then its multiples up to the largest step",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_CAPTURE_ALL",
        BOOLEAN,
        False,
        "capture every graph bucket at start (default: each on its DEEPINFER_CUDAGRAPH_CAPTURE_ON_USE-th use)",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_CAPTURE_ON_USE",
        integer(lo=1),
        2,
        "a graph bucket is captured the N-th time a step needs it, the step running uncaptured before (same "
        "results): buckets a probe or one batch size needs once cost no capture; 1: capture on first use",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_BATCH_INVARIANT",
        BOOLEAN,
        True,
        "replay decode CUDA graphs in batch-invariant mode too; 0: such steps run eagerly",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_DRAFT",
        BOOLEAN,
        True,
        "greedy DSpark drafts replay CUDA graphs too; 0: they run eagerly",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_CUDAGRAPH_COMPILE",
        choice(*COMPILE_BACKENDS, none=("", "0", "none")),
        None,
        "torch.compile backend of the graphed decode step before capture (inductor fuses the elementwise ops "
        "between the GEMMs); unset / none: the step as written",
        _ENGINE,
    ),
    # parallelism and EPLB
    EnvVar(
        "DEEPINFER_DP_SIZE",
        integer(),
        None,
        "data-parallel size of a launched rank's layout",
        "deepinfer_cluster.layout",
    ),
    EnvVar(
        "DEEPINFER_CP_SIZE",
        integer(),
        None,
        "context-parallel size of a launched rank's layout",
        "deepinfer_cluster.layout",
    ),
    EnvVar(
        "DEEPINFER_EP_SIZE",
        integer(),
        None,
        "expert-parallel size of a launched rank's layout",
        "deepinfer_cluster.layout",
    ),
    EnvVar(
        "DEEPINFER_DIST_START_METHOD",
        choice("fork", "spawn", "forkserver"),
        "fork",
        "how local ranks are started (spawn if a parent's threads make fork unsafe)",
        "deepinfer_parallel.launch",
    ),
    EnvVar(
        "DEEPINFER_DP_ROUTING",
        choice(*DP_ROUTING_POLICIES),
        "balanced",
        "how the data-parallel front routes requests to its ranks: balanced (queued tokens, KV usage and "
        "prefix-cache overlap; waiting requests move between ranks), static (longest first per batch) or "
        "round_robin; EngineArgs.dp_routing overrides",
        "deepinfer.engine_args",
    ),
    EnvVar(
        "DEEPINFER_EP_BACKEND",
        choice("auto", "torch", "deepep"),
        "auto",
        "MoE dispatch / combine under "
        "expert parallelism: auto (DeepEP on CUDA when deep_ep imports, else torch), torch (exact), deepep",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_EP_SHARD_DRAFT_EXPERTS",
        BOOLEAN,
        True,
        "under expert parallelism, shard the DSpark draft blocks' routed experts over the EP ranks "
        "(their own redundant-expert rounding; every rank joins each draft forward's all-to-alls) "
        "instead of holding all of them on every rank",
        _ENGINE,
    ),
    EnvVar(
        "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS",
        integer(0),
        32,
        "minimum number of redundant (replica) expert "
        "slots, rounded up to fill the EP ranks (the reference's default is 0)",
        "deepinfer_parallel.redundant",
    ),
    EnvVar(
        "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL",
        integer(0),
        0,
        "EPLB rebalance period in steps (0: never)",
        _EPLB,
    ),
    EnvVar("DEEPINFER_EXPERT_COUNT_WINDOW_SIZE", integer(), 100, "EPLB history window in steps", _EPLB),
    EnvVar(
        "DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE",
        BOOLEAN,
        False,
        "count prefill steps and rebalance right after a prefill",
        _EPLB,
    ),
    EnvVar("DEEPINFER_REARRANGE_P2P_GROUPS", integer(1), 1, "P2P buckets of an EPLB weight shuffle", _EPLB),
    EnvVar(
        "DEEPINFER_EPLB_MAX_WINDOW_STEPS",
        integer(0),
        0,
        "EPLB plans on at most this many buckets of consecutive steps (0: every step)",
        _EPLB,
    ),
    EnvVar(
        "DEEPINFER_MOE_LB_STAT_INTERVAL", integer(1), 128, "steps between MoE load-balance all-gathers", _EPLB
    ),
]


def _reference_knob(name: str, kind: Kind, default: Any, doc: str) -> EnvVar:
    return EnvVar(PREFIX + name, kind, default, doc, "", used=False)


# The reference's knobs of subsystems this engine does not have (engine spec §1.5): recognised, not read.
_VARS += [
    _reference_knob("SAMPLER_FORCE_TOPK", integer(0), 0, "sample only among the top-K logits"),
    _reference_knob("COMPUTE_SUM_SMALLER_PROBS", BOOLEAN, False, "extra sampler statistic"),
    _reference_knob("JIT_CACHE_DIR", TEXT, None, "root of the JIT kernel caches"),
    _reference_knob("NCCL_NUM_SMS", integer(), 32, "NCCL process-group CTAs"),
    _reference_knob("USERBUFFER_COMM_SMS", integer(0), 0, "SMs given to DeepEP dispatch / combine (0: auto)"),
    _reference_knob("GLOO_TIMEOUT", integer(), 14400, "gloo process-group timeout (s)"),
    _reference_knob("FORCE_IMBALANCE_RATIO", real(), 0.0, "profiling: routing skewed toward EP rank 0"),
    _reference_knob("FORCE_LOAD_BALANCE", BOOLEAN, False, "random expert choice in the gate"),
    _reference_knob("SHOW_EPLB_DETAIL", BOOLEAN, False, "per-layer expert load table after a rebalance"),
    _reference_knob(
        "PREFILL_MAX_SUM_SEQLEN_K", integer(), None, "cap on the summed lengths of a prefill batch"
    ),
    _reference_knob(
        "INDEX_ATTN_MEMORY_LIMIT", integer(), 10 << 30, "indexer scoring workspace bound (bytes)"
    ),
    _reference_knob("ENGRAM_FORCE_GPU_STORAGE", BOOLEAN, False, "Engram tables on the GPU"),
    _reference_knob("DFLASH_ENFORCE_EAGER", BOOLEAN, False, "no DFlash CUDA graphs"),
    _reference_knob("DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL", integer(), 8, "DFlash graph bucket spacing"),
    _reference_knob("DECODE_PERF_CACHE_DIR", TEXT, None, "cache of decode performance curves"),
    _reference_knob("DECODE_PERF_CACHE_TTL_SEC", integer(), 3600, "lifetime of those cache files (s)"),
    _reference_knob("NUM_STATE_SLOTS_RATIO", real(), 1.2, "state slots per max_num_seqs"),
    _reference_knob(
        "PREFILL_STORE_EXTRA_STATE", BOOLEAN, False, "extra SWA history for an external KV store"
    ),
    _reference_knob("PREFILL_STORE_EXTRA_SIZE", integer(), 128, "size of that extra history"),
    _reference_knob("XGRAMMAR_DEBUG", BOOLEAN, False, "verbose grammar matcher tracing"),
    _reference_knob(
        "XGRAMMAR_DISABLE_CACHE",
        BOOLEAN,
        False,
        "no grammar compile cache (here: GrammarCompileService(cache_entries=0))",
    ),
    _reference_knob(
        "XGRAMMAR_CACHE_LIMIT_BYTES",
        integer(),
        10 << 30,
        "grammar cache byte cap (here: GrammarCompileService(cache_limit_bytes=...))",
    ),
    _reference_knob("SO_BUILDER_CPUS", integer(), 4, "pinned cores of grammar-compile threads"),
    _reference_knob("PREFILL_ATTEMPT_INTERVAL", integer(), 70, "NORMAL engine ALL-prefill vote period"),
    _reference_knob("PREFILL_ANY_ATTEMPT_INTERVAL", integer(), 100, "NORMAL engine ANY-prefill vote period"),
    _reference_knob("NCCL_MEMORY_SAMPLE_INTERVAL_STEPS", integer(1), 1000, "NCCL memory snapshot period"),
    _reference_knob("RINGBUFFER_WARNING_INTERVAL", integer(), 60, "shared-memory broadcast wait warning (s)"),
    _reference_knob("DISABLE_SYNC_GUARD", BOOLEAN, False, "no CPU-GPU sync guard during launch"),
    _reference_knob("PROFILE_TORCH_CUDA_MEMORY", BOOLEAN, False, "torch CUDA memory-history recording"),
    _reference_knob("ENABLE_MEMORY_TRACING", BOOLEAN, False, "memory snapshot of the profile run"),
    _reference_knob("PROFILE_HTTP_ENABLE", BOOLEAN, False, "per-engine profiling HTTP server"),
    _reference_knob("PROFILE_HTTP_PORT_BASE", integer(), 6070, "its port base"),
    _reference_knob("TORCH_PROFILER_DIR", TEXT, "/tmp", "trace output directory"),
    _reference_knob("USE_MULTIMODAL_POOL", BOOLEAN, False, "pinned pool of preprocessed images"),
    _reference_knob("MULTIMODAL_POOL_SIZE_GB", integer(), 8, "its size per rank (GB)"),
    _reference_knob("MULTI_MODAL_BUFFER_SIZE", integer(), 512, "vision worker output queue bound"),
    _reference_knob("CPP_LOG_LEVEL", choice("off", "error", "warn", "info"), "info", "C++ log level"),
    _reference_knob("FUSED_SAMPLE_STRESS_TEST", BOOLEAN, False, "test knob of the fused sampler"),
    _reference_knob("FUSED_SAMPLE_DETAIL_LOG", BOOLEAN, False, "test knob of the fused sampler"),
]

VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}
if len(VARS) != len(_VARS):
    raise RuntimeError("an environment variable is declared twice")
KNOWN_NAMES = frozenset(VARS)


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of `name` in `environ` (default: the process environment) now, parsed; its default unset."""
    var = VARS[name]
    raw = (os.environ if environ is None else environ).get(name)
    return var.default if raw is None else var.parse(raw)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user gave `name` (as opposed to its default applying)."""
    if name not in VARS:
        raise KeyError(f"{name} is not a DeepInfer environment variable")
    return name in (os.environ if environ is None else environ)


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
    """Warn (once per name) about DEEPINFER_* variables nobody declared; returns the unknown names."""
    unknown = sorted(n for n in os.environ if n.startswith(PREFIX) and n not in KNOWN_NAMES)
    for name in unknown:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"unknown environment variable {name} is ignored (typo?)", stacklevel=2)
    return unknown


def markdown_table() -> str:
    """The README's table: one row per variable this engine reads, then the recognised reference knobs."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for var in sorted(VARS.values(), key=lambda v: not v.used):
        meaning = var.doc if var.used else f"reference knob, not used here: {var.doc}"
        rows.append(f"| `{var.name}` | {var.default_text} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
