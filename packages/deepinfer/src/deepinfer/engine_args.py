"""`EngineArgs`: every engine knob, with the reference's names and defaults where they fit a CPU host.

`add_cli_args` / `from_cli_args` expose each field as a `--kebab-case` flag, so the CLI and the
Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from . import envs


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
            "help": "attention data parallel: N > 1 runs N rank processes, each with its own scheduler "
            "and batch (0 and 1: one process)"
        },
    )
    context_parallel_size: int = field(default=1, metadata={"help": "1 only in this engine"})
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "MoE expert parallel: routed experts sharded over groups of this many DP ranks "
            "(a divisor of data_parallel_size; 1: every rank holds all experts)"
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
    engine_type: str = field(
        default="normal", metadata={"help": "normal only (prompt / completion: PD split)"}
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
        if str(self.engine_type).lower() != "normal":
            raise ValueError(
                f"engine_type must be 'normal' (prompt / completion engines are not wired in), got {self.engine_type!r}"
            )
        if self.model is None:
            self.model = envs.DEEPINFER_HF_MODEL_DIR
        if self.device is None:
            self.device = envs.DEEPINFER_DEVICE
        device = self.torch_device  # validate now: a clear error naming `device` before anything is loaded
        if self.data_parallel_size > 1 and device.type == "cuda":
            import torch

            # one GPU per rank: rank r runs on cuda:r
            if str(self.device).strip().lower().startswith("cuda:"):
                raise ValueError(
                    f"device must be cpu, cuda or auto with data_parallel_size={self.data_parallel_size} "
                    f"(rank r runs on cuda:r), got {self.device!r}"
                )
            if torch.cuda.device_count() < self.data_parallel_size:
                raise ValueError(
                    f"data_parallel_size={self.data_parallel_size} needs one CUDA device per rank; this "
                    f"machine has {torch.cuda.device_count()}"
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
        if self.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size must be 1 in this engine (context-parallel prefill is not wired "
                f"in), got {self.context_parallel_size!r}"
            )
        dp = max(1, self.data_parallel_size)
        from deepinfer_parallel import validate_parallel_sizes

        try:  # the rule the process groups enforce (EP groups are contiguous blocks of DP ranks)
            validate_parallel_sizes(
                dp * self.context_parallel_size, dp=dp, cp=1, ep=self.expert_parallel_size
            )
        except ValueError as e:
            allowed = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ValueError(
                f"expert_parallel_size must divide data_parallel_size={dp} (one of {allowed}), "
                f"got {self.expert_parallel_size!r} ({e})"
            ) from None
        if self.expert_parallel_size > 1:
            from deepinfer_model import refuse_with_expert_parallelism

            refuse_with_expert_parallelism("expert_parallel_size > 1")  # DEEPINFER_FP8_EXPERTS=1: no EP path
        if self.expert_parallel_size > 1 and self.runner != "paged":
            # the recompute runner runs one forward per sequence: ranks could not match their all-to-alls
            raise ValueError(f"expert_parallel_size > 1 needs runner = 'paged', got runner = {self.runner!r}")

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
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if "default:" not in help_text:  # each default printed once
                help_text += f" (default: {f.default})"
            if f.type in ("bool", bool):
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
                )
            else:
                kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                group.add_argument(flag, type=kind, default=f.default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
