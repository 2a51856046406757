"""Decode-perplexity workloads: fixed prompts, fixed lengths, greedy decoding with a fixed seq_seed.

Prompts are token ids drawn from a seeded generator (the tiny model has random weights, so natural
text would measure nothing more, and ids need no tokenizer round trip). The same workloads exist on
every platform; CPU sizes are scaled down so the tiny model finishes in CI. A baseline is keyed by
(platform, workload name), so one name means one shape per platform: a GPU run of a workload at the CPU's
size (a checkpoint whose context is too short) is named `<name>.cpu_size`, and the full-size and scaled
records of one GPU platform live side by side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

# Token ids below this are avoided: special and byte-level tokens of the DeepSeek vocabulary.
_FIRST_ID = 1000
_LAST_ID = 100_000
# Name suffix of a GPU workload run at its CPU size (see the module docstring).
SCALED_SUFFIX = ".cpu_size"


@dataclass(frozen=True)
class PplWorkload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    nextn: int = 0  # draft tokens per decode step (DEEPINFER_USE_NEXTN_DECODE) while it runs
    long_context: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("num_prompts", "input_len", "output_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.nextn < 0:
            raise ValueError(f"nextn must be >= 0, got {self.nextn}")

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        high = min(_LAST_ID, vocab_size)
        low = min(_FIRST_ID, high - 1)
        return [rng.integers(low, high, self.input_len).tolist() for _ in range(self.num_prompts)]

    def seq_seed(self, index: int) -> int:
        return self.seed * 1_000_003 + index

    def describe(self) -> dict:
        return asdict(self)


# Full sizes: the reference's long-context check (16,389 prompt tokens, 4,096 output tokens, nextn 5).
GPU_WORKLOADS = (
    PplWorkload("short", num_prompts=16, input_len=512, output_len=512, nextn=5),
    PplWorkload(
        "long_context", num_prompts=1, input_len=16_389, output_len=4_096, nextn=5, long_context=True
    ),
)
# CPU: the same workloads scaled to the tiny model (256-token context) on a small host (long_context keeps
# its ~4:1 in:out shape and an odd length that crosses block and compression boundaries). On a GPU these
# sizes run as `<name>.cpu_size`.
CPU_WORKLOADS = (
    PplWorkload("short", num_prompts=3, input_len=21, output_len=8),
    PplWorkload("long_context", num_prompts=1, input_len=197, output_len=48, long_context=True),
)


def workloads_for(platform: str, max_model_len: int | None = None) -> tuple[PplWorkload, ...]:
    """The workloads of `platform`: the CPU sizes on `cpu`; on GPUs the full sizes, except that a workload
    that does not fit a model's context (`max_model_len`; the 256-token tiny model) runs at its CPU size
    under the name `<name>.cpu_size`, so it is compared with the scaled baseline, never the full-size one."""
    if platform == "cpu":
        return CPU_WORKLOADS
    if max_model_len is None:
        return GPU_WORKLOADS
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    scaled = {w.name: replace(w, name=w.name + SCALED_SUFFIX) for w in CPU_WORKLOADS}
    return tuple(w if w.input_len + w.output_len <= max_model_len else scaled[w.name] for w in GPU_WORKLOADS)


def workload(platform: str, name: str, max_model_len: int | None = None) -> PplWorkload:
    known = workloads_for(platform, max_model_len)
    for w in known:
        if w.name == name:
            return w
    raise ValueError(f"no workload {name!r} for platform {platform!r}; known: {[w.name for w in known]}")
