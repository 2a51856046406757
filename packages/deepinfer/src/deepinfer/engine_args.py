"""`EngineArgs`: every engine knob, with the reference's names and defaults where they fit a CPU host.

`add_cli_args` / `from_cli_args` expose each field as a `--kebab-case` flag, so the CLI and the
Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from . import envs

ENGINE_TYPES = ("normal", "prompt", "completion")
DISAGGREGATION_MODES = ("off", "shm", "tcp")


@dataclass
class EngineArgs:
    model: str | None = field(
        default=None,
        metadata={
            "help": "checkpoint directory, or org/name[@revision] already in the local Hugging Face cache "
            "(default: $DEEPINFER_HF_MODEL_DIR, else the built-in deepinfer-tiny)"
        },
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer directory (default: the model's)"}
    )
    seed: int = field(
        default=0, metadata={"help": "engine seed: derives seq_seed of requests that give none"}
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "max prompt + output tokens (default: min(4096, the model's limit))"}
    )
    max_num_seqs: int = field(default=256, metadata={"help": "max sequences in one step"})
    max_num_batched_tokens: int | None = field(
        default=None, metadata={"help": "max tokens in one step (default: max(max_model_len, 4096))"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (reference: 128)"})
    num_kv_blocks: int | None = field(
        default=None,
        metadata={"help": "KV blocks in the pool (default: enough for max_num_seqs full sequences)"},
    )
    runner: str = field(
        default="paged",
        metadata={
            "help": "model runner: paged (per-layer-kind paged KV caches, incremental) or recompute "
            "(re-runs the whole prefix every step: exact, O(n^2), a debugging baseline)"
        },
    )
    chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts across steps"})
    async_scheduling: bool = field(
        default=True,
        metadata={
            "help": "schedule step N+1 while step N runs (ZOS); $DEEPINFER_ZERO_OVERHEAD_SCHEDULING overrides"
        },
    )
    stop_preempted_request: bool = field(
        default=False,
        metadata={
            "help": "a sequence preempted for want of KV blocks finishes with the tokens it has "
            "(finish_reason 'insufficient_system_resource') instead of being recomputed later"
        },
    )
    load_format: str = field(
        default="auto", metadata={"help": "auto (safetensors) or dummy (random weights)"}
    )
    dtype: str = field(default="float32", metadata={"help": "compute dtype of the CPU reference model"})
    device: str | None = field(
        default=None,
        metadata={
            "help": "where the model, its KV cache and sampling run: auto (cuda if torch.cuda.is_available() "
            "else cpu), cpu, cuda or cuda:N (default: $DEEPINFER_DEVICE, else auto)"
        },
    )
    num_threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads (default: torch's)"}
    )
    disable_log_stats: bool = field(default=True, metadata={"help": "no periodic stats log lines"})
    # Reference knobs accepted for compatibility; values this engine cannot honour are rejected.
    served_model_name: str = field(default="deepinfer-model", metadata={"help": "name reported in outputs"})
    trust_remote_code: bool = field(default=False, metadata={"help": "accepted; no remote code is ever run"})
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "CUDA: share of the device's memory this engine may fill; the KV cache gets what is left "
            "of it after the weights (engine/kv_sizing.py). Ignored on the CPU (num_kv_blocks sizes the cache)"
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "no CUDA graphs: every step runs eagerly (also $DEEPINFER_ENFORCE_EAGER)"},
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={"help": "reuse the KV blocks of identical full-block prompt prefixes across requests"},
    )
    data_parallel_size: int = field(
        default=0,
        metadata={
            "help": "attention data parallel: rank groups with their own scheduler and batch (0: derived, "
            "the reference's rule: the launched world size / context_parallel_size, else "
            "max(1, expert_parallel_size // context_parallel_size))",
            "aliases": ("--dp",),
        },
    )
    context_parallel_size: int = field(
        default=1,
        metadata={
            "help": "context parallel: each data-parallel rank is this many processes that split long "
            "prompts' prefill (the balanced mirror split); must divide the world size",
            "aliases": ("--cp",),
        },
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "MoE expert parallel: routed experts sharded over contiguous blocks of this many ranks "
            "(a divisor of data_parallel_size * context_parallel_size; 1: every rank holds all experts)",
            "aliases": ("--ep",),
        },
    )
    launcher: str = field(
        default="auto",
        metadata={
            "help": "who starts the ranks of a parallel layout: spawn (this process spawns them on this host "
            "and fronts them), external (this process is one rank started by `deepinfer launch` or torchrun: "
            "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), auto (external when RANK and "
            "WORLD_SIZE are set, else spawn)"
        },
    )
    distributed_timeout: int = field(
        default=600,
        metadata={
            "help": "seconds a running data-parallel rank may go without a sign of life (it beats every "
            "second) or without progress (a step done) before the front names it and fails"
        },
    )
    distributed_startup_timeout: int = field(
        default=1800,
        metadata={
            "help": "seconds the data-parallel ranks have to start (load the model, join the process "
            "groups) before the front names the late ones and fails"
        },
    )
    dp_routing: str | None = field(
        default=None,
        metadata={
            "help": "how the data-parallel front routes requests to its ranks: balanced (by queued tokens, KV "
            "usage and prefix-cache overlap; waiting requests move between ranks), static (longest first per "
            "batch) or round_robin (default: $DEEPINFER_DP_ROUTING, else balanced)"
        },
    )
    engine_type: str = field(
        default="normal",
        metadata={
            "help": "normal (prefill and decode), prompt (prefill only: each request ends 'prefilled' and "
            "leaves as a hand-off record) or completion (decode only: takes hand-off records; needs "
            "--stop-preempted-request). A disaggregated front (--disaggregation) starts one of each"
        },
    )
    disaggregation: str = field(
        default="off",
        metadata={
            "help": "prefill / decode disaggregation: off, shm (a prompt and a completion engine process on "
            "this host, hand-offs through shared memory) or tcp (the same, hand-offs over TCP sockets)"
        },
    )
    disaggregation_max_held: int = field(
        default=8,
        metadata={
            "help": "hand-offs the disaggregated front holds while the completion engine is full; the "
            "prompt engine gets no new request while this many are held or being prefilled"
        },
    )
    kv_host_tier_bytes: int | None = field(
        default=None,
        metadata={
            "help": "host memory (bytes) that keeps prefix-cache blocks the device cache evicts; a later "
            "prefix hit there loads them instead of recomputing (default: $DEEPINFER_KV_HOST_TIER_BYTES, 0 = off)"
        },
    )
    kv_disk_tier_bytes: int | None = field(
        default=None,
        metadata={
            "help": "disk (bytes) below the host tier, in kv_disk_tier_dir "
            "(default: $DEEPINFER_KV_DISK_TIER_BYTES, 0 = off)"
        },
    )
    kv_disk_tier_dir: str | None = field(
        default=None,
        metadata={"help": "directory of the disk KV tier (default: $DEEPINFER_KV_DISK_TIER_DIR)"},
    )
    encoder_cache_tokens: int | None = field(
        default=None,
        metadata={
            "help": "image embedding rows (image tokens) the encoder cache keeps, so an image sent again is "
            "not encoded again; least recently used images go first (default: "
            "$DEEPINFER_ENCODER_CACHE_TOKENS, 65536: 64 images at the 1,024-token budget)"
        },
    )

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        for name in ("stop_preempted_request",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.runner not in ("paged", "recompute"):
            raise ValueError(f"runner must be 'paged' or 'recompute', got {self.runner!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"dtype must be float32, bfloat16 or float64, got {self.dtype!r}")
        if (
            not isinstance(self.gpu_memory_utilization, int | float)
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        self._check_parallel_sizes()
        self._check_disaggregation()
        self._resolve_kv_tier()
        if self.dp_routing is None:
            self.dp_routing = envs.DEEPINFER_DP_ROUTING
        if self.dp_routing not in envs.DP_ROUTING_POLICIES:
            raise ValueError(
                f"dp_routing must be one of {', '.join(envs.DP_ROUTING_POLICIES)}, got {self.dp_routing!r}"
            )
        if self.encoder_cache_tokens is None:
            self.encoder_cache_tokens = envs.DEEPINFER_ENCODER_CACHE_TOKENS
        value = self.encoder_cache_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"encoder_cache_tokens must be an integer >= 1, got {value!r}")
        if self.model is None:
            self.model = envs.DEEPINFER_HF_MODEL_DIR
        if self.device is None:
            self.device = envs.DEEPINFER_DEVICE
        device = self.torch_device  # validate now: a clear error naming `device` before anything is loaded
        if self.world_size > 1 and self.launched is None and device.type == "cuda":
            import torch

            # one GPU per rank: rank r runs on cuda:r
            if str(self.device).strip().lower().startswith("cuda:"):
                raise ValueError(
                    f"device must be cpu, cuda or auto with {self.world_size} ranks "
                    f"(rank r runs on cuda:r), got {self.device!r}"
                )
            if torch.cuda.device_count() < self.world_size:
                raise ValueError(
                    f"{self.layout.describe()} needs one CUDA device per rank; this machine has "
                    f"{torch.cuda.device_count()}"
                )

    def _check_disaggregation(self) -> None:
        """engine_type and disaggregation: the allowed values, and what each needs."""
        self.engine_type = str(self.engine_type).lower()
        if self.engine_type not in ENGINE_TYPES:
            raise ValueError(
                f"engine_type must be one of {', '.join(ENGINE_TYPES)}, got {self.engine_type!r}"
            )
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation must be one of {', '.join(DISAGGREGATION_MODES)}, got {self.disaggregation!r}"
            )
        v = self.disaggregation_max_held
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"disaggregation_max_held must be an integer >= 1, got {v!r}")
        split = self.engine_type != "normal" or self.disaggregation != "off"
        if not split:
            return
        if self.engine_type != "normal" and self.disaggregation != "off":
            raise ValueError(
                f"disaggregation={self.disaggregation!r} starts its own prompt and completion engines: "
                f"engine_type must be 'normal' there, got {self.engine_type!r}"
            )
        if self.runner != "paged":
            raise ValueError(f"prefill / decode disaggregation needs runner='paged', got {self.runner!r}")
        if self.world_size > 1:
            raise ValueError(
                f"prefill / decode disaggregation runs one engine per role, got {self.layout.describe()}"
            )
        if self.engine_type == "completion" and not self.stop_preempted_request:
            raise ValueError(
                "engine_type='completion' needs stop_preempted_request=True (a decode-only engine cannot "
                "recompute a preempted sequence's prompt)"
            )

    def _resolve_kv_tier(self) -> None:
        """Tier sizes from the fields, else the environment; a disk tier needs its directory."""
        if self.kv_host_tier_bytes is None:
            self.kv_host_tier_bytes = envs.DEEPINFER_KV_HOST_TIER_BYTES
        if self.kv_disk_tier_bytes is None:
            self.kv_disk_tier_bytes = envs.DEEPINFER_KV_DISK_TIER_BYTES
        if self.kv_disk_tier_dir is None:
            self.kv_disk_tier_dir = envs.DEEPINFER_KV_DISK_TIER_DIR
        for name in ("kv_host_tier_bytes", "kv_disk_tier_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (bytes; 0 = off), got {value!r}")
        if self.kv_disk_tier_bytes > 0 and not self.kv_disk_tier_dir:
            raise ValueError(
                f"kv_disk_tier_dir must name a directory when kv_disk_tier_bytes > 0 "
                f"(got kv_disk_tier_bytes={self.kv_disk_tier_bytes}, kv_disk_tier_dir={self.kv_disk_tier_dir!r})"
            )

    def _check_parallel_sizes(self) -> None:
        for name, low in (
            ("data_parallel_size", 0),
            ("context_parallel_size", 1),
            ("expert_parallel_size", 1),
            ("distributed_timeout", 1),
            ("distributed_startup_timeout", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.launcher not in ("auto", "spawn", "external"):
            raise ValueError(f"launcher must be auto, spawn or external, got {self.launcher!r}")
        from deepinfer_cluster import derive_layout, launched_rank

        launched = launched_rank() if self.launcher != "spawn" else None
        if self.launcher == "external" and launched is None:
            raise ValueError(
                "launcher = 'external' needs RANK and WORLD_SIZE in the environment (start the ranks with "
                "`deepinfer launch --nproc N -- ...` or torchrun)"
            )
        if launched is not None and launched.world_size == 1 and self.launcher == "auto":
            launched = None  # a world of one: nothing to rendezvous with
        self.launched = launched
        if launched is not None:  # what the launcher exported fills in what the arguments leave at default
            for name, exported, default, var in (
                ("data_parallel_size", launched.dp, 0, "DEEPINFER_DP_SIZE"),
                ("context_parallel_size", launched.cp, 1, "DEEPINFER_CP_SIZE"),
                ("expert_parallel_size", launched.ep, 1, "DEEPINFER_EP_SIZE"),
            ):
                value = getattr(self, name)
                if exported is None or value == exported:
                    continue
                if value != default:
                    raise ValueError(
                        f"{name}={value} disagrees with the launcher's layout ({var}={exported}): give the "
                        "size in one place (the launcher's --dp / --cp / --ep or the engine's)"
                    )
                setattr(self, name, exported)
        self.layout = derive_layout(
            self.data_parallel_size,
            self.context_parallel_size,
            self.expert_parallel_size,
            launched.world_size if launched is not None else None,
        )
        self.data_parallel_size = self.layout.dp
        if self.context_parallel_size > 1 and self.runner != "paged":
            raise ValueError(
                f"context_parallel_size > 1 needs runner = 'paged', got runner = {self.runner!r}"
            )
        if self.expert_parallel_size > 1:
            from deepinfer_model import refuse_with_expert_parallelism

            refuse_with_expert_parallelism("expert_parallel_size > 1")  # DEEPINFER_FP8_EXPERTS=1: no EP path
        if self.expert_parallel_size > 1 and self.runner != "paged":
            # the recompute runner runs one forward per sequence: ranks could not match their all-to-alls
            raise ValueError(f"expert_parallel_size > 1 needs runner = 'paged', got runner = {self.runner!r}")

    @property
    def world_size(self) -> int:
        """Processes of the layout: data_parallel_size * context_parallel_size."""
        return self.layout.world_size

    @property
    def torch_device(self):
        """`device` resolved (auto -> cuda if available else cpu) and checked against this machine."""
        from deepinfer_model import resolve_device

        return resolve_device(self.device, "device")

    @property
    def use_async(self) -> bool:
        env = envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING
        return self.async_scheduling if env is None else bool(env)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("engine arguments")
        for f in dataclasses.fields(EngineArgs):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_text = f.metadata.get("help", "")
            if "default:" not in help_text:  # each default printed once
                help_text += f" (default: {f.default})"
            if f.type in ("bool", bool):
                group.add_argument(
                    *flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
                )
            else:
                kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                group.add_argument(*flags, type=kind, default=f.default, help=help_text)
        return parser

    def fields(self) -> dict:
        """The fields as keyword arguments (`LLM(**args.fields())`), without what `__post_init__` derived."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
